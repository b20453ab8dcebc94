"""The report of ``vllm-pamer train``: ``report.md`` (methods against the
observable controls and the paper's numbers, per-source AUROC, verdicts by
a paired task bootstrap), ``results.json`` and the ROC / AUROC plots. Reads an
``ExperimentResult`` of ``experiment.run_experiment``; fits nothing.

Longer than 400 lines because it is one document: its sections, tables,
verdicts and plots are written in the order the report reads."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from vllm_pamer.training.annotate import annotator_definition
from vllm_pamer.training.experiment import ExperimentResult
from vllm_pamer.training.metrics import (
    BOOT_DRAWS,
    Fold,
    auroc,
    binary_metrics,
    paired_auroc_test,
    roc_curve,
    sign_flip_p,
)

SIGNIFICANT = 0.05
"""The paired test's p below which a verdict reads \"beats\"."""

# The PaMER paper's numbers: test means over five question-grouped splits.
# Keys are our method roles; "head" rows quote the no-hint probes of Table 8
# (our serialized input carries no memory-token hint).
PAPER: dict[str, dict[str, dict[str, Any]]] = {
    "compression": {
        "length_turn": {"auroc": (0.751, 0.066), "auprc": (0.533, 0.053), "where": "Table 1 / Table 7 (Length + turn)"},
        "last_tool": {"auroc": (0.562, 0.026), "auprc": (0.335, 0.054), "where": "Table 7 (Last tool type)"},
        "metadata": {
            "auroc": (0.758, 0.056),
            "auprc": (0.543, 0.054),
            "where": "Table 1 / Table 7 (Length + turn + tool type)",
        },
        "tfidf": {"auroc": (0.616, 0.027), "auprc": (0.416, 0.072), "where": "Table 7 (Recent2 TF-IDF)"},
        "full_linear": {
            "auroc": (0.831, 0.036),
            "auprc": (0.670, 0.100),
            "f1": (0.601, None),
            "where": "Table 1 Hidden (Linear); Table 9 Final RMSNorm, last; F1 Table 8 no-hint linear",
        },
        "full_mlp": {
            "auroc": (0.827, None),
            "auprc": (0.665, None),
            "f1": (0.606, None),
            "where": "Table 1 Hidden (MLP); Table 8 no-hint MLP "
            "(faithful-hint teacher: 0.829 / 0.690 / 0.639, Tables 6 and 9)",
        },
        "recent2": {
            "auroc": (0.776, None),
            "f1": (0.541, None),
            "where": "Table 2 / Table 11 Recent2 (26.0% of full tokens)",
        },
        "recent2_kd": {
            "auroc": (0.781, None),
            "f1": (0.598, None),
            "agreement": (0.819, None),
            "where": "Table 2 / Table 11 Recent2 + decision KD",
        },
    },
    "recall": {
        "length_turn": {"auroc": (0.552, 0.074), "auprc": (0.336, 0.036), "where": "Table 1 / Table 7 (Length + turn)"},
        "last_tool": {"auroc": (0.527, 0.056), "auprc": (0.315, 0.043), "where": "Table 7 (Last tool type)"},
        "metadata": {
            "auroc": (0.549, 0.058),
            "auprc": (0.361, 0.066),
            "where": "Table 1 / Table 7 (Length + turn + tool type)",
        },
        "tfidf": {"auroc": (0.610, 0.056), "auprc": (0.398, 0.075), "where": "Table 7 (Recent2 TF-IDF)"},
        "full_linear": {
            "auroc": (0.765, 0.067),
            "auprc": (0.584, 0.106),
            "f1": (0.526, None),
            "where": "Table 1 Hidden (Linear); Table 9 Final RMSNorm, last; F1 Table 8 no-hint linear",
        },
        "full_mlp": {
            "auroc": (0.763, None),
            "auprc": (0.592, None),
            "f1": (0.541, None),
            "where": "Table 1 Hidden (MLP); Table 8 no-hint MLP "
            "(faithful-hint teacher: 0.780 / 0.597 / 0.558, Tables 6 and 9)",
        },
        "recent2": {"auroc": (0.761, None), "f1": (0.520, None), "where": "Table 2 / Table 11 Recent2"},
        "recent2_kd": {
            "auroc": (0.753, None),
            "f1": (0.548, None),
            "agreement": (0.840, None),
            "where": "Table 2 / Table 11 Recent2 + decision KD",
        },
    },
}


def _paper_key(method_key: str) -> str | None:
    if method_key.endswith("@full"):
        return None
    if method_key.startswith("recent2_"):
        return "recent2_kd" if method_key.endswith("_kd") else "recent2"
    return method_key


def fmt_estimate(value: tuple[float, float | None] | None, digits: int = 3) -> str:
    if value is None:
        return "·"
    mean, sd = value
    if mean is None or not math.isfinite(mean):
        return "n/a"
    return f"{mean:.{digits}f}" + (f" ± {sd:.{digits}f}" if sd is not None and math.isfinite(sd) else "")


def _plots(result: ExperimentResult, report_dir: Path) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    summary = result.summary()
    keys = [k for k in result.methods if k in summary]
    written = []

    seed0 = result.seeds[0]
    fig, ax = plt.subplots(figsize=(6.4, 6.0))
    for key in keys:
        entry = seed0["methods"][key]
        fpr, tpr = roc_curve(seed0["test_labels"], entry["test_scores"])
        family = result.methods[key].family
        ax.plot(
            fpr,
            tpr,
            linestyle="-" if family == "hidden" else "--",
            linewidth=1.6 if family == "hidden" else 1.2,
            label=f"{result.methods[key].label} ({entry['test']['auroc']:.3f})",
        )
    ax.plot([0, 1], [0, 1], color="grey", linewidth=0.8, linestyle=":")
    ax.set_xlabel("false positive rate")
    ax.set_ylabel("true positive rate")
    ax.set_title(f"ROC, {result.config.target}, test split of seed {seed0['seed']}")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(report_dir / "roc.png", dpi=130)
    plt.close(fig)
    written.append("roc.png")

    fig, ax = plt.subplots(figsize=(8.0, 4.8))
    means = [summary[k]["auroc"][0] for k in keys]
    sds = [summary[k]["auroc"][1] for k in keys]
    colors = ["#7f7f7f" if result.methods[k].family == "control" else "#1f77b4" for k in keys]
    positions = np.arange(len(keys))
    ax.bar(positions, means, yerr=sds, color=colors, capsize=3, label="ours (mean ± sd over seeds)")
    paper = PAPER[result.config.target]
    marked = False
    for pos, key in zip(positions, keys):
        ref = paper.get(_paper_key(key) or "", {}).get("auroc")
        if ref is not None:
            ax.plot(
                pos,
                ref[0],
                marker="D",
                color="black",
                markersize=5,
                linestyle="none",
                label=None if marked else "paper (Tables 1/2/7/9)",
            )
            marked = True
    ax.axhline(0.5, color="grey", linewidth=0.8, linestyle=":")
    ax.set_xticks(
        positions, [result.methods[k].label.replace(", ", ",\n", 1) for k in keys], rotation=35, ha="right", fontsize=7
    )
    ax.set_ylabel("test AUROC")
    ax.set_ylim(0.3, 1.0)
    ax.set_title(f"AUROC by method ({result.config.target})")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(report_dir / "auroc.png", dpi=130)
    plt.close(fig)
    written.append("auroc.png")
    return written


def _comparison(result: ExperimentResult, key: str, against: str, source: str | None = None) -> dict[str, float]:
    """``key`` minus ``against`` in test AUROC on the same points (within
    ``source`` when given): the mean over seeds, the seeds it wins, the
    sign-flip p over seeds and the paired task bootstrap (``paired_auroc_test``)."""
    folds, d = [], []
    for s in result.seeds:
        if key not in s["methods"] or against not in s["methods"]:
            continue
        mask = s["test_sources"] == source if source is not None else np.ones(len(s["test_labels"]), dtype=bool)
        fold = Fold(
            s["test_labels"][mask],
            s["methods"][key]["test_scores"][mask],
            s["methods"][against]["test_scores"][mask],
            s["test_groups"][mask],
        )
        folds.append(fold)
        d.append(auroc(fold.y, fold.scores_a) - auroc(fold.y, fold.scores_b))
    d = [x for x in d if math.isfinite(x)]
    paired = paired_auroc_test(folds)
    return {
        "delta": float(np.mean(d)) if d else float("nan"),
        "wins": sum(x > 0 for x in d),
        "n": len(d),
        "p_seeds": sign_flip_p(d),
        "lo": paired["lo"],
        "hi": paired["hi"],
        "p": paired["p"],
        "tasks": paired["tasks"],
    }


def _paired_text(c: Mapping[str, float]) -> str:
    seeds = f"{c['wins']}/{c['n']} splits better, sign-flip p = {c['p_seeds']:.4f}"
    if not math.isfinite(c["p"]):
        return f"Δ = {c['delta']:+.3f} ({int(c['tasks'])} test tasks: too few for the paired test; {seeds})"
    return (
        f"Δ = {c['delta']:+.3f} (95% CI {c['lo']:+.3f} to {c['hi']:+.3f}, paired task bootstrap p = {c['p']:.4f} "
        f"over {int(c['tasks'])} test tasks; {seeds})"
    )


def _verdict(c: Mapping[str, float]) -> str:
    if c["delta"] > 0 and c["p"] < SIGNIFICANT:
        return "**beats**"
    if c["delta"] > 0:
        return "is **not significantly** above"
    return "**does not beat**"


def _verdict_line(result: ExperimentResult, key: str, best_control: str) -> str:
    c = _comparison(result, key, best_control)
    label = result.methods[key].label
    control = result.methods[best_control].label
    if not math.isfinite(c["delta"]):
        return f"- {label}: no comparable seeds."
    return f"- {label} {_verdict(c)} {control}: {_paired_text(c)}."


def _vote_line(result: ExperimentResult) -> str:
    """How the exported heads' vote decides on the test split, where every seed shares it."""
    cfg = result.config
    if not cfg.held_out:
        return (
            "- Each head was trained on a different split, so there is no common held-out set on which to score the "
            f"{cfg.min_votes}-of-{len(cfg.seeds)} vote; the per-seed test metrics above are the honest numbers."
        )
    seeds = result.seeds
    y = seeds[0]["test_labels"]
    served = result.export_method + ("@full" if cfg.export == "student" else "")  # what the server feeds them
    fired = sum((s["methods"][served]["test_scores"] > t).astype(int) for s, t in zip(seeds, result.thresholds))
    vote = binary_metrics(y, fired.astype(float), cfg.min_votes - 0.5)
    return (
        f"- The {cfg.min_votes}-of-{len(seeds)} vote of the exported heads on the test split they share "
        f"({vote['n']} points, {vote['positive_rate']:.0%} positive): F1 {vote['f1']:.3f}, precision "
        f"{vote['precision']:.3f}, recall {vote['recall']:.3f}; AUROC of the vote count {vote['auroc']:.3f}."
    )


def write_report(
    result: ExperimentResult,
    report_dir: str | Path,
    heads_path: str | Path | None = None,
    fingerprint: Any = None,
    inputs: Mapping[str, Any] | None = None,
    layerwise: Any = None,
) -> Path:
    """``report.md``, ``results.json`` and the PNG plots into ``report_dir``;
    ``layerwise`` (a ``LayerwiseResult``, written beside it) is summarized."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    cfg = result.config
    summary = result.summary()
    paper = PAPER[cfg.target]
    other_target = "recall" if cfg.target == "compression" else "compression"
    plots = _plots(result, report_dir)

    lines: list[str] = [f"# PaMER heads: {cfg.target} ({time.strftime('%Y-%m-%d %H:%M')})", ""]
    data = result.data
    lines += [
        "## Data",
        "",
        f"- States: `{(inputs or {}).get('states', '(in memory)')}`; d = {data['hidden_size']}.",
        f"- {data['labelled']} of {data['rows']} decision points have a {cfg.target} label "
        f"(None rows excluded); {data['positives']} positive ({data['positive_rate']:.1%}).",
        f"- {data['trajectories']} trajectories in {data['tasks']} tasks (split unit); "
        f"{data['truncated']} rows had a truncated input.",
    ]
    for source, info in data["sources"].items():
        lines.append(f"- `{source}`: {info['rows']} rows, {info['positive_rate']:.1%} positive.")
    for name in data.get("annotators", []):
        lines.append(f"- Labels by the `{name}` annotator: {annotator_definition(name) or 'not registered here'}.")
    lines += [
        "",
        "## Protocol",
        "",
        f"- Seeds {', '.join(map(str, cfg.seeds))}; "
        + (
            "test: the evaluation split's rows (vllm_pamer/data/splits.json), the same at every seed; per seed the "
            f"tuning split's tasks {1 - cfg.fractions[1]:.0%} train / {cfg.fractions[1]:.0%} validation"
            if cfg.held_out
            else "per seed a {:.0%}/{:.0%}/{:.0%} split".format(*cfg.fractions)
        )
        + " by task (all trials of a tau-bench task together); rho = N-/N+ of the train split; inputs standardized "
        "with train statistics "
        f"({'on' if cfg.standardize else 'off'}; folded into the exported weights).",
        f"- Heads: {cfg.head}, width {cfg.hidden} for MLPs, exact-erf GELU; AdamW lr {cfg.lr:g}, weight decay "
        f"{cfg.weight_decay:g}, batch {cfg.batch_size}, {cfg.epochs} epochs; checkpoint = epoch of lowest "
        "validation WBCE; threshold = validation-F1-best, fixed for test.",
        f"- Teacher: the {cfg.head} head on full-context states. "
        + (
            f"Student: the {cfg.head} head on Recent2 "
            f"(`P + R_t`) states with decision distillation, loss WBCE(z, y) + {cfg.distill_weight:g} · "
            "BCEWithLogits(z, sigmoid(teacher logit)), the teacher scoring the same decision points (its own "
            "training rows, as in the paper's fixed-teacher setup); the student's checkpoint is chosen by "
            "validation WBCE alone."
            if any(k.startswith("recent2") for k in result.methods)
            else "No student: the states hold the full context alone."
        ),
        "- Controls: class-weighted logistic regression (L-BFGS, L2 with C = 1) on the same splits. Length + turn = "
        "full-context tokens (before the probe cut), Recent2 tokens, tokens(O_t), user turns and agent steps (raw "
        "and log1p, standardized); tool type = "
        "one-hot last tool (train vocabulary); TF-IDF = lowercase unigrams of the Recent2 text, train vocabulary "
        "(df >= 2, top 20,000), smooth idf, L2 rows.",
        "- Metrics on the test split: AUROC (primary, ties count 1/2), AUPRC (average precision), F1 at the "
        "validation threshold; mean ± sample sd over seeds. Agreement = share of test decisions equal to the "
        "teacher's (paper eq. 24).",
        "",
        "## Results (test split, mean ± sd over seeds)",
        "",
        "| method | AUROC | AUPRC | F1 | teacher agreement | per-seed AUROC |",
        "|---|---|---|---|---|---|",
    ]
    for key, method in result.methods.items():
        if key not in summary:
            continue
        s = summary[key]
        per_seed = " ".join(f"{x['methods'][key]['test']['auroc']:.3f}" for x in result.seeds if key in x["methods"])
        lines.append(
            f"| {method.label} | {fmt_estimate(s['auroc'])} | {fmt_estimate(s['auprc'])} | {fmt_estimate(s['f1'])} | "
            f"{fmt_estimate(s.get('agreement'))} | {per_seed} |"
        )
    by_source = result.by_source()
    sources = sorted(data["sources"])
    if len(sources) > 1:
        lines += [
            "",
            "Test AUROC within each source (the sources differ in base rate, length and tools, so a pooled AUROC "
            "can reward telling the sources apart):",
            "",
            "| method | " + " | ".join(f"`{x}`" for x in sources) + " |",
            "|---|" + "---|" * len(sources),
        ]
        for key, method in result.methods.items():
            if key in summary:
                lines.append(
                    f"| {method.label} | " + " | ".join(fmt_estimate(by_source[key][x]) for x in sources) + " |"
                )
    lines += [
        "",
        "Split sizes (rows, train/val/test): "
        + "; ".join(
            f"seed {x['seed']}: {x['sizes']['train']}/{x['sizes']['val']}/{x['sizes']['test']} "
            f"({x['tasks']['train']}/{x['tasks']['val']}/{x['tasks']['test']} tasks, "
            f"test {x['test_positive_rate']:.0%} positive)"
            for x in result.seeds
        ),
        "",
        "## Beside the paper",
        "",
        f"The paper's numbers ({cfg.target}; Qwen3.5-9B states, d = 4096, 72,912 LLM-annotated decision points "
        "of 2,521 trajectories over 600 questions) and ours:",
        "",
        "| method | ours AUROC | paper AUROC | ours AUPRC | paper AUPRC | ours F1 | paper F1 | paper source |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for key, method in result.methods.items():
        ref = paper.get(_paper_key(key) or "")
        if key not in summary or ref is None:
            continue
        s = summary[key]
        lines.append(
            f"| {method.label} | {fmt_estimate(s['auroc'])} | {fmt_estimate(ref.get('auroc'))} | "
            f"{fmt_estimate(s['auprc'])} | {fmt_estimate(ref.get('auprc'))} | "
            f"{fmt_estimate(s['f1'])} | {fmt_estimate(ref.get('f1'))} | {ref['where']} |"
        )
    ref_other = PAPER[other_target]
    lines += [
        "",
        f"For reference, the paper's {other_target} numbers: "
        f"length + turn {fmt_estimate(ref_other['length_turn']['auroc'])}, "
        f"metadata {fmt_estimate(ref_other['metadata']['auroc'])}, "
        f"hidden linear {fmt_estimate(ref_other['full_linear']['auroc'])}, "
        f"hidden MLP {fmt_estimate(ref_other['full_mlp']['auroc'])}, "
        f"Recent2 {fmt_estimate(ref_other['recent2']['auroc'])}, "
        f"Recent2 + KD {fmt_estimate(ref_other['recent2_kd']['auroc'])}. "
        "Paper Table 1 headline: hidden 0.831 (compression) "
        "and 0.765 (recall) against metadata 0.758 and 0.549.",
        "",
        "## Does the hidden state beat the controls here?",
        "",
    ]
    controls = [k for k, m in result.methods.items() if m.family == "control" and k in summary]
    best_control = max(controls, key=lambda k: summary[k]["auroc"][0] if math.isfinite(summary[k]["auroc"][0]) else -1)
    lines.append(
        f"Best control by mean test AUROC: {result.methods[best_control].label} "
        f"({fmt_estimate(summary[best_control]['auroc'])})."
    )
    lines.append("")
    for key, method in result.methods.items():
        if method.family == "hidden" and key in summary:
            lines.append(_verdict_line(result, key, best_control))
    sources = sorted(data["sources"])
    if len(sources) > 1:
        by_source = result.by_source()
        for source in sources:
            finite = [k for k in controls if math.isfinite(by_source[k][source][0])]
            hidden = result.export_method
            if not finite or not math.isfinite(by_source[hidden][source][0]):
                lines.append(f"- Within `{source}`: AUROC undefined on some split (one class only).")
                continue
            best = max(finite, key=lambda k: by_source[k][source][0])
            c = _comparison(result, hidden, best, source)
            lines.append(
                f"- Within `{source}` only: the exported heads ({result.methods[hidden].label}) reach "
                f"{fmt_estimate(by_source[hidden][source])} against {fmt_estimate(by_source[best][source])} "
                f"for the best control there ({result.methods[best].label}): {_verdict(c)} it, {_paired_text(c)}."
            )
    kd, plain = f"recent2_{cfg.head}_kd", f"recent2_{cfg.head}"
    if plain in summary:
        c = _comparison(result, kd, plain)
        df1 = summary[kd]["f1"][0] - summary[plain]["f1"][0]
        lines.append(
            f"- Decision distillation vs plain Recent2: ΔAUROC {_paired_text(c)}, "
            f"ΔF1 {df1:+.3f} (paper: +0.0058 AUROC, +0.057 F1 for compression, Table 10)."
        )
    lines += [
        "",
        "The verdicts read the paired task bootstrap: both methods scored on the same test points, each of "
        f"{BOOT_DRAWS:,} draws resampling every split's test tasks with replacement (decision points of one task are "
        f'dependent, and the split unit is the task); "beats" means Δ > 0 with p < {SIGNIFICANT:g}. The test reads '
        "the test points given the trained heads; how much training moves them is the seeds' spread. With five "
        "seeds the smallest two-sided sign-flip p over seeds is 2/32 = 0.0625 (paper A.6), so that test, printed "
        "beside it, cannot reach 0.05; it shows how consistent a difference is across splits.",
        "",
        "Caveats when reading these against the paper: our labels are an offline annotator's *silver* labels "
        "(above; docs/annotation.md), not an LLM annotator's; the model is the served model (here "
        f"{getattr(fingerprint, 'model_name', '') or 'see fingerprint'}, d = {data['hidden_size']}), not a frozen 9B "
        "extractor; the data set is two orders of magnitude smaller and has far fewer tasks, so the split-to-split "
        "spread is larger.",
        "",
        "## Exported heads",
        "",
    ]
    if heads_path is not None:
        lines.append(
            f"- `{heads_path}`: one head per seed ({', '.join(map(str, cfg.seeds))}) from "
            f"**{result.methods[result.export_method].label}** (`--export {cfg.export}`), "
            f"min_votes = {cfg.min_votes}, trained = true, thresholds (logits) "
            + ", ".join(f"{t:+.3f}" for t in result.thresholds)
            + "."
        )
        if fingerprint is not None:
            lines.append(
                f"- Model fingerprint: {fingerprint.architecture}, hidden {fingerprint.hidden_size}, "
                f"{fingerprint.num_hidden_layers} layers, vocab {fingerprint.vocab_size}, "
                f"name `{fingerprint.model_name}`."
            )
    on_full = result.methods.get(f"recent2_{cfg.head}_kd@full")
    lines += [
        "- The server evaluates the heads on the final-norm state captured at the prefill of the *served* request "
        "(the full effective context), not on a separate `P + R_t` pass. `--export full` (default) therefore "
        "exports the full-context heads; `--export student` exports the paper's Recent2 distillation students. "
        + (
            f"The row '{on_full.label}' measures a student fed what the server would feed it."
            if on_full
            else "The states were extracted without Recent2 (`--inputs full`), so no student was trained."
        ),
        _vote_line(result),
        "",
        "## Across layers",
        "",
    ]
    if layerwise is None:
        lines.append(
            "- Not measured in this run (`vllm-pamer extract --layers`, then `vllm-pamer train --layer-states`)."
        )
    else:
        for target in layerwise.cells:
            lines.append(
                f"- {target}: test AUROC of linear probes, last token / mean pooling: "
                + "; ".join(
                    f"{tap} {fmt_estimate(layerwise.summary(target, tap, 'last'))} / "
                    f"{fmt_estimate(layerwise.summary(target, tap, 'mean'))}"
                    for tap in layerwise.taps
                )
                + f" ({layerwise.data[target]['rows']} points)."
            )
        lines.append("- Tables, logit gaps and the plot: [layerwise.md](layerwise.md).")
    lines += ["", "## Notes", ""]
    lines += [f"- {note}" for note in result.notes]
    if not plots:
        lines.append("- Plots skipped: matplotlib is not installed.")
    lines += ["", "## Plots", ""]
    if "roc.png" in plots:
        lines += [f"ROC curves on one test split (seed {result.seeds[0]['seed']:d}):", "", "![ROC](roc.png)", ""]
    if "auroc.png" in plots:
        lines += ["Test AUROC by method (bars: ours, mean ± sd; diamonds: paper):", "", "![AUROC](auroc.png)", ""]
    lines += [f"Training and evaluation took {result.seconds:.0f} s.", ""]
    (report_dir / "report.md").write_text("\n".join(lines))
    (report_dir / "results.json").write_text(json.dumps(results_json(result, inputs), indent=1))
    return report_dir / "report.md"


def results_json(result: ExperimentResult, inputs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Everything but the raw scores, JSON-ready."""
    seeds = []
    for s in result.seeds:
        seeds.append(
            {
                **{k: v for k, v in s.items() if k not in ("methods", "test_labels", "test_sources", "test_groups")},
                "methods": {
                    key: {k: v for k, v in entry.items() if k != "test_scores"} for key, entry in s["methods"].items()
                },
            }
        )
    return {
        "config": asdict(result.config),
        "inputs": dict(inputs or {}),
        "data": result.data,
        "methods": {k: asdict(m) for k, m in result.methods.items()},
        "summary": {k: {m: list(v) for m, v in d.items()} for k, d in result.summary().items()},
        "auroc_by_source": {k: {m: list(v) for m, v in d.items()} for k, d in result.by_source().items()},
        "seeds": seeds,
        "export_method": result.export_method,
        "thresholds": result.thresholds,
        "notes": result.notes,
        "seconds": result.seconds,
        "paper": {
            k: {m: {x: list(y) if isinstance(y, tuple) else y for x, y in d.items()} for m, d in v.items()}
            for k, v in PAPER.items()
        },
    }
