"""The depth diagnostic (paper §3.3, Figure 1, Table 9): how well compression
and recall can be read from each tapped layer, at the last prompt token and
averaged over the prompt.

Input: a ``vllm-pamer extract --layers`` directory (``layers_last`` /
``layers_mean``, ``[n, taps, d]``, full context). For every tap, pooling and
target, an independent **linear** probe (as in the paper) is trained with the
same protocol as ``experiment.py``: task-grouped 70/15/15 splits over seeds 0-4,
train-split standardization, class-weighted BCE, AdamW, the epoch with the
lowest validation loss. Reported per cell: test AUROC and AUPRC (mean ± sd
over seeds) and the logit gap ``E[z | y=1] - E[z | y=0]`` on test (eq. 6).

``vllm-pamer train --layer-states DIR --report R`` writes ``layerwise.md``,
``layerwise.json`` and ``layerwise.png`` into ``R``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_pamer.training.experiment import TARGETS, target_labels
from vllm_pamer.training.metrics import auprc, auroc, mean_sd
from vllm_pamer.training.probes import Standardizer, fit_head
from vllm_pamer.training.report import fmt_estimate
from vllm_pamer.training.splits import grouped_split
from vllm_pamer.trajectories import task_of

POOLINGS = ("last", "mean")

# Table 9 of the paper (Qwen3.5-9B, linear probes, no hint): AUROC mean ± sd.
PAPER_TABLE9: dict[str, dict[str, dict[str, tuple[float, float]]]] = {
    "compression": {
        "Block 4": {"last": (0.757, 0.051), "mean": (0.706, 0.027)},
        "Block 8": {"last": (0.799, 0.044), "mean": (0.735, 0.044)},
        "Block 16": {"last": (0.810, 0.031), "mean": (0.762, 0.048)},
        "Block 24": {"last": (0.814, 0.024), "mean": (0.756, 0.049)},
        "Block 32": {"last": (0.824, 0.032), "mean": (0.708, 0.059)},
        "Final RMSNorm": {"last": (0.831, 0.036), "mean": (0.712, 0.058)},
    },
    "recall": {
        "Block 4": {"last": (0.722, 0.058), "mean": (0.632, 0.073)},
        "Block 8": {"last": (0.768, 0.053), "mean": (0.690, 0.058)},
        "Block 16": {"last": (0.780, 0.054), "mean": (0.741, 0.048)},
        "Block 24": {"last": (0.765, 0.061), "mean": (0.726, 0.059)},
        "Block 32": {"last": (0.743, 0.088), "mean": (0.692, 0.045)},
        "Final RMSNorm": {"last": (0.765, 0.067), "mean": (0.696, 0.047)},
    },
}


@dataclass
class LayerwiseResult:
    taps: list[str]
    num_layers: int | None
    seeds: tuple[int, ...]
    cells: dict[str, dict[str, dict[str, dict[str, list[float]]]]] = field(default_factory=dict)
    """target -> tap -> pooling -> metric -> per-seed test values."""
    data: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    def summary(self, target: str, tap: str, pooling: str, metric: str = "auroc") -> tuple[float, float]:
        return mean_sd(self.cells[target][tap][pooling][metric])


def run_layerwise(
    last: np.ndarray,
    mean: np.ndarray,
    taps: Sequence[str],
    meta: Sequence[Mapping[str, Any]],
    *,
    seeds: Sequence[int] = (0, 1, 2, 3, 4),
    targets: Sequence[str] = TARGETS,
    epochs: int = 50,
    num_layers: int | None = None,
    log: Callable[[str], None] = print,
    progress: bool = True,
) -> LayerwiseResult:
    """Train and test one linear probe per (target, tap, pooling, seed)."""
    from tqdm import tqdm

    last = np.asarray(last, dtype=np.float32)
    mean = np.asarray(mean, dtype=np.float32)
    if last.shape != mean.shape or last.shape[0] != len(meta) or last.shape[1] != len(taps):
        raise ValueError(f"last {last.shape}, mean {mean.shape}, {len(taps)} taps and {len(meta)} rows disagree")
    started = time.monotonic()
    result = LayerwiseResult(taps=list(taps), num_layers=num_layers, seeds=tuple(seeds))
    jobs = len(targets) * len(seeds) * len(taps) * len(POOLINGS)
    bar = tqdm(total=jobs, unit="probe", desc="layerwise", disable=not progress)
    states = {"last": last, "mean": mean}
    try:
        for target in targets:
            labels = target_labels(meta, target)
            keep = np.flatnonzero(labels >= 0)
            y = labels[keep]
            groups = [task_of(str(meta[i]["trajectory_id"])) for i in keep]
            result.data[target] = {"rows": int(keep.size), "positives": int(y.sum()), "tasks": len(set(groups))}
            cells = result.cells[target] = {
                tap: {p: {"auroc": [], "auprc": [], "gap": []} for p in POOLINGS} for tap in taps
            }
            for seed in seeds:
                train, val, test = grouped_split(groups, seed)
                n_pos = int(y[train].sum())
                if n_pos == 0 or n_pos == train.size:
                    raise ValueError(f"{target}, seed {seed}: the train split has a single class")
                rho = (train.size - n_pos) / n_pos
                for t, tap in enumerate(taps):
                    for pooling in POOLINGS:
                        x = states[pooling][keep, t]
                        std = Standardizer.fit(x[train])
                        head, _, _ = fit_head(
                            std(x[train]),
                            torch.from_numpy(y[train]),
                            std(x[val]),
                            torch.from_numpy(y[val]),
                            kind="linear",
                            rho=rho,
                            seed=seed,
                            epochs=epochs,
                        )
                        with torch.no_grad():
                            z = head(std(x[test])).double().numpy()
                        y_test = y[test]
                        cell = cells[tap][pooling]
                        cell["auroc"].append(auroc(y_test, z))
                        cell["auprc"].append(auprc(y_test, z))
                        cell["gap"].append(float(z[y_test == 1].mean() - z[y_test == 0].mean()))
                        bar.update(1)
            log(
                f"[layerwise] {target}: "
                + ", ".join(
                    f"{tap} {result.summary(target, tap, 'last')[0]:.3f}/{result.summary(target, tap, 'mean')[0]:.3f}"
                    for tap in taps
                )
                + " (AUROC last/mean)"
            )
    finally:
        bar.close()
    result.seconds = time.monotonic() - started
    return result


def _tap_label(tap: str, num_layers: int | None) -> str:
    if tap == "norm":
        return "final norm"
    block = int(tap.removeprefix("block"))
    return f"block {block}" + (f" ({block}/{num_layers})" if num_layers else "")


def _plot(result: LayerwiseResult, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    targets = list(result.cells)
    fig, axes = plt.subplots(2, len(targets), figsize=(5.2 * len(targets), 7.0), squeeze=False)
    x = np.arange(len(result.taps))
    labels = [_tap_label(t, result.num_layers).replace(" (", "\n(") for t in result.taps]
    for col, target in enumerate(targets):
        for row, metric in enumerate(("auroc", "gap")):
            ax = axes[row][col]
            for pooling, style in zip(POOLINGS, ("-o", "--s")):
                means, sds = zip(*(result.summary(target, tap, pooling, metric) for tap in result.taps))
                ax.errorbar(
                    x,
                    means,
                    yerr=sds,
                    fmt=style,
                    capsize=3,
                    label=f"{pooling} token" if pooling == "last" else "mean pooling",
                )
            ax.set_xticks(x, labels, fontsize=7)
            ax.set_ylabel("test AUROC" if metric == "auroc" else "logit gap E[z|1] - E[z|0]")
            if metric == "auroc":
                ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
                ax.set_title(f"{target}: AUROC by layer (linear probes)")
            else:
                ax.set_title(f"{target}: positive-minus-negative logit")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def write_layerwise_report(
    result: LayerwiseResult, report_dir: str | Path, inputs: Mapping[str, Any] | None = None
) -> Path:
    """``layerwise.md``, ``layerwise.json`` and ``layerwise.png`` into ``report_dir``."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    plotted = _plot(result, report_dir / "layerwise.png")
    lines = [
        "# Memory signals across layers",
        "",
        "Independent linear probes per tapped layer, pooling and target, trained like the shipped heads "
        f"(task-grouped 70/15/15 splits, seeds {', '.join(map(str, result.seeds))}; class-weighted BCE; "
        "best validation epoch). Test metrics, mean ± sd over seeds. `last`: the state at the last prompt "
        "token; `mean`: averaged over every prompt token (prefix caching off during extraction, so every "
        "token was computed).",
        "",
    ]
    for target, data in result.data.items():
        lines.append(
            f"- {target}: {data['rows']} labelled points ({data['positives']} positive), {data['tasks']} tasks."
        )
    lines.append("")
    for target in result.cells:
        lines += [
            f"## {target.capitalize()}",
            "",
            "| layer | pooling | AUROC | AUPRC | logit gap |",
            "|---|---|---|---|---|",
        ]
        for tap in result.taps:
            for pooling in POOLINGS:
                lines.append(
                    f"| {_tap_label(tap, result.num_layers)} | {pooling} | "
                    + " | ".join(
                        fmt_estimate(result.summary(target, tap, pooling, m)) for m in ("auroc", "auprc", "gap")
                    )
                    + " |"
                )
        best = max(result.taps, key=lambda tap: result.summary(target, tap, "last")[0])
        wins = sum(
            result.summary(target, tap, "last")[0] > result.summary(target, tap, "mean")[0] for tap in result.taps
        )
        lines += [
            "",
            f"Highest last-token AUROC: {_tap_label(best, result.num_layers)}. Last token beats mean pooling at "
            f"{wins} of {len(result.taps)} layers.",
            "",
            "The paper (Table 9, Qwen3.5-9B, AUROC last / mean): "
            + "; ".join(f"{name} {v['last'][0]:.3f} / {v['mean'][0]:.3f}" for name, v in PAPER_TABLE9[target].items())
            + ".",
            "",
        ]
    if plotted:
        lines += ["![AUROC and logit gap by layer](layerwise.png)", ""]
    lines += [f"The probes took {result.seconds:.0f} s.", ""]
    path = report_dir / "layerwise.md"
    path.write_text("\n".join(lines))
    payload = {
        "inputs": dict(inputs or {}),
        "taps": result.taps,
        "num_layers": result.num_layers,
        "seeds": list(result.seeds),
        "data": result.data,
        "cells": result.cells,
        "seconds": result.seconds,
    }
    (report_dir / "layerwise.json").write_text(json.dumps(payload, indent=1))
    return path
