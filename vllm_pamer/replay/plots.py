"""The plots of a replay report (matplotlib, when installed): context and
latency per turn, cost against evidence, evidence against plain recency."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from statistics import mean

from vllm_pamer.replay.evidence import FrontierPoint, recency_curve
from vllm_pamer.replay.records import PolicyRow, StepRecord


def per_step(records: Sequence[StepRecord], value: Callable[[StepRecord], float | None]) -> dict[str, dict[int, float]]:
    """Mean ``value`` of the answered requests by step index, per policy."""
    sums: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        if r.status == "ok" and (v := value(r)) is not None:
            sums[r.policy][r.step].append(v)
    return {p: {s: mean(v) for s, v in sorted(steps.items())} for p, steps in sums.items()}


def context_per_turn(records: Sequence[StepRecord]) -> dict[str, dict[int, float]]:
    """Mean ``prompt_tokens_out`` by step index, per policy."""
    return per_step(records, lambda r: r.prompt_tokens_out)


def _pyplot():
    """matplotlib's pyplot on the file backend, or None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt, figure, axes, path: str | Path) -> None:
    """Grid, legend beside the axes (labels would overlap inside), file."""
    axes.grid(alpha=0.3)
    axes.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _styles(n: int) -> list[dict]:
    """Distinct colours for up to 20 series (matplotlib's default cycle repeats after 10)."""
    import matplotlib

    # matplotlib types the registry's maps as Colormap; tab10/tab20 are listed
    colours = matplotlib.colormaps["tab10" if n <= 10 else "tab20"].colors  # type: ignore[attr-defined]
    return [{"color": colours[i % len(colours)]} for i in range(n)]


def _scatter_policies(axes, points: Sequence[tuple[str, float, float]]) -> None:
    """One marker per (policy, x, evidence share), evidence drawn in percent,
    above any line on the axes."""
    markers = "osD^vP*Xh<>p"
    for i, ((policy, x, evidence), style) in enumerate(zip(points, _styles(len(points)))):
        axes.scatter(
            x, 100 * evidence, s=40, color=style["color"], marker=markers[i % len(markers)], label=policy, zorder=3
        )


def _plot_per_step(curves: dict[str, dict[int, float]], path: str | Path, ylabel: str, title: str) -> bool:
    plt = _pyplot()
    if plt is None or not curves:
        return False
    figure, axes = plt.subplots(figsize=(8.5, 4))
    for (policy, points), style in zip(curves.items(), _styles(len(curves))):
        axes.plot(list(points), list(points.values()), label=policy, linewidth=1.5, **style)
    axes.set_xlabel("turn (decision point)")
    axes.set_ylabel(ylabel)
    axes.set_title(title)
    _save(plt, figure, axes, path)
    return True


def plot_context_per_turn(records: Sequence[StepRecord], path: str | Path, label: str = "") -> bool:
    """The paper's Figure 3 for this replay: mean context per turn, one line per
    policy. False (nothing written) without matplotlib or data."""
    title = "Context size per turn" + (f" ({label})" if label else "")
    return _plot_per_step(context_per_turn(records), path, "mean prompt tokens sent", title)


def plot_latency_per_step(records: Sequence[StepRecord], path: str | Path, label: str = "") -> bool:
    """Mean end-to-end latency per turn, one line per policy: a compaction
    the request waited for shows as a peak. False without matplotlib or data."""
    title = "Latency per turn" + (f" ({label})" if label else "")
    return _plot_per_step(per_step(records, lambda r: r.latency_s), path, "mean end-to-end latency (s)", title)


def plot_evidence_vs_chars(
    rows: Sequence[PolicyRow], frontier: Sequence[FrontierPoint], path: str | Path, label: str = ""
) -> bool:
    """One point per policy, characters kept (x) against evidence kept (y), over
    the line plain recency draws on the same requests: a policy above the line
    keeps more for its characters than dropping old blocks. False (nothing
    written) without matplotlib, rows or frontier."""
    points = [
        (r.policy, r.chars_share, r.evidence_availability)
        for r in rows
        if r.chars_share is not None and r.evidence_availability is not None
    ]
    curve = recency_curve(frontier)
    plt = _pyplot()
    if plt is None or not points or not curve:
        return False
    figure, axes = plt.subplots(figsize=(8.5, 4.5))
    axes.plot(
        [100 * x for x, _ in curve],
        [100 * y for _, y in curve],
        "--",
        color="grey",
        linewidth=1.2,
        label=f"recent_k, k = {min(p.k for p in frontier)}..{max(p.k for p in frontier)}",
    )
    _scatter_policies(axes, [(policy, 100 * chars, evidence) for policy, chars, evidence in points])
    axes.set_xlabel("chars share (%): characters sent over the full history's")
    axes.set_ylabel("evidence availability (%)")
    axes.set_title("Evidence for the characters kept, against recency" + (f" ({label})" if label else ""))
    _save(plt, figure, axes, path)
    return True


def plot_cost_vs_evidence(rows: Sequence[PolicyRow], path: str | Path, label: str = "") -> bool:
    """One point per policy: prefill the engine computed (x) against the
    evidence the next action needs that is still readable (y), the trade-off a
    token count alone hides. False (nothing written) without the figures."""
    points = [
        (r.policy, r.prefill_computed, r.evidence_availability)
        for r in rows
        if r.prefill_computed is not None and r.evidence_availability is not None
    ]
    plt = _pyplot()
    if plt is None or not points:
        return False
    figure, axes = plt.subplots(figsize=(8.5, 4.5))
    _scatter_policies(axes, points)
    axes.set_xlabel("prefill tokens computed (prompt tokens not served from the prefix cache)")
    axes.set_ylabel("evidence availability (%)")
    axes.set_title("Cost and evidence per policy" + (f" ({label})" if label else ""))
    _save(plt, figure, axes, path)
    return True


def plot_all(
    out: Path,
    records: Sequence[StepRecord],
    rows: Sequence[PolicyRow],
    frontier: Sequence[FrontierPoint],
    suffix: str = "",
    label: str = "",
) -> list[str]:
    """The plots (``context_per_turn<suffix>.png``, ``latency_per_step<suffix>.png``, ``cost_vs_evidence<suffix>.png``,
    ``evidence_vs_chars<suffix>.png`` given a frontier); the markdown lines of those written."""
    lines = []
    for stem, title, plotted in (
        ("context_per_turn", "context size per turn", lambda path: plot_context_per_turn(records, path, label)),
        ("latency_per_step", "latency per turn", lambda path: plot_latency_per_step(records, path, label)),
        ("cost_vs_evidence", "cost and evidence", lambda path: plot_cost_vs_evidence(rows, path, label)),
        (
            "evidence_vs_chars",
            "evidence against recency",
            lambda path: plot_evidence_vs_chars(rows, frontier, path, label),
        ),
    ):
        name = f"{stem}{suffix}.png"
        if plotted(out / name):
            lines.append(f"\n![{title}{', ' + label if label else ''}]({name})\n")
    return lines
