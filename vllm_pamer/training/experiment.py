"""The experiment of ``vllm-pamer train``: the five compression heads measured
against observable controls (PaMER paper §3.1-3.4, Appendix A.2-A.4 and B.2).

Input: the rows of an extraction directory (``data.load_states``): ``full``
[n, d] = final-norm state of the last token of the full served context,
``recent2`` [n, d] = the same for the compact ``P + R_t`` input (None when
extracted without it: the Recent2 rows are then left out), and one metadata
dict per row (trajectory_id, source, step, message_index, tokens, turn,
last_tool, recall, compression).

Protocol, per seed (it fixes both the split and the init):

* rows whose target label is None are dropped; the rest are split by *task*
  (``trajectories.task_of``: all trials of a tau-bench task together):
  ``fractions`` of all rows, or (``held_out``) tested on the evaluation split;
* inputs are standardized with train-split statistics (folded into the
  exported weights, so the served heads read raw states);
* heads (``probes``: linear or MLP, exact-erf GELU as
  ``kernels.five_head_vote_reference``) are trained with AdamW on
  class-weighted BCE, ``rho = N-/N+`` of the train split (eq. 4); the
  checkpoint is the epoch of lowest validation label loss;
* the teacher is the head on full-context states; the student reads Recent2
  states with decision distillation (eq. 25), the teacher scoring the same points;
* each method's threshold is the validation-F1-best one (eq. 14), then fixed
  for test, where AUROC (primary), AUPRC and F1 are measured;
* controls (``controls``) on the same splits: logistic regressions on length
  + turn, last tool type, both, and Recent2 TF-IDF when texts exist.

Output: an ``ExperimentResult``: per seed and method the metrics and test
scores (``report`` writes them up), and one exported head per seed with its
threshold in logit space (``probes.stack_heads`` makes the heads file).

Which heads are exported (``TrainConfig.export``): ``full`` (default), those
trained on full-context states, the state the server captures at the prefill
of the served request; ``student``, the Recent2 distillation students as the
paper deploys them (its extractor reads ``P + R_t``). The student is also
measured on full-context states, to show what the mismatch costs.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from vllm_pamer.training.controls import TfidfCorpus, fit_logistic, length_turn_features, tool_one_hot
from vllm_pamer.training.metrics import auroc, binary_metrics, mean_sd, select_threshold
from vllm_pamer.training.probes import (
    HIDDEN_WIDTH,
    FittedHead,
    Standardizer,
    export_head,
    fit_head,
    torch_threads,
)
from vllm_pamer.training.splits import grouped_split, held_out_split
from vllm_pamer.trajectories import split_of, task_of

TARGETS = ("compression", "recall")
NUM_SEEDS = 5


@dataclass
class TrainConfig:
    target: str = "compression"
    head: str = "mlp"
    """Architecture of the teacher / student / exported heads: mlp or linear."""
    export: str = "full"
    """Exported heads: ``full`` (trained on full-context states, what the server
    captures) or ``student`` (Recent2 distillation students, the paper's choice)."""
    seeds: tuple[int, ...] = (0, 1, 2, 3, 4)
    epochs: int = 50
    lr: float = 1e-3
    batch_size: int = 256
    weight_decay: float = 0.01
    distill_weight: float = 0.5
    hidden: int = HIDDEN_WIDTH
    fractions: tuple[float, float, float] = (0.7, 0.15, 0.15)
    held_out: bool = False
    """Test on the evaluation split's rows (``trajectories.split_of``) at every
    seed, train and validate on the tuning split's tasks (``fractions[1]`` of
    them validate: ``splits.held_out_split``); False: ``fractions`` of all rows."""
    standardize: bool = True
    ablations: bool = True
    """Also train the other-architecture full-context head and the Recent2 head
    without distillation (Table 1 / Table 2 rows)."""
    min_votes: int = 3
    tfidf_max_features: int = 20000
    threads: int | None = 1
    """torch CPU threads while training (restored afterwards): one, as more
    contend with other work on a small machine; None leaves torch's setting."""


@dataclass
class Method:
    key: str
    label: str
    family: str  # "control" | "hidden"


@dataclass
class ExperimentResult:
    config: TrainConfig
    data: dict[str, Any]
    methods: dict[str, Method]
    seeds: list[dict[str, Any]] = field(default_factory=list)
    """Per seed: split sizes, rho, and per method: threshold, val / test metrics,
    test labels, sources, tasks and scores (ROC curves, the paired test)."""
    exported: list[dict[str, np.ndarray]] = field(default_factory=list)
    thresholds: list[float] = field(default_factory=list)
    export_method: str = ""
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def summary(self) -> dict[str, dict[str, tuple[float, float]]]:
        """Method -> metric -> (mean, sd) over seeds, on test."""
        out: dict[str, dict[str, tuple[float, float]]] = {}
        for key in self.methods:
            per_seed = [s["methods"][key] for s in self.seeds if key in s["methods"]]
            if not per_seed:
                continue
            out[key] = {metric: mean_sd([m["test"][metric] for m in per_seed]) for metric in ("auroc", "auprc", "f1")}
            if "agreement" in per_seed[0]:
                out[key]["agreement"] = mean_sd([m["agreement"] for m in per_seed])
        return out

    def by_source(self) -> dict[str, dict[str, tuple[float, float]]]:
        """Method -> source -> test AUROC (mean, sd over seeds) within that source."""
        out: dict[str, dict[str, tuple[float, float]]] = {}
        sources = sorted(self.data.get("sources", {}))
        for key in self.methods:
            per_source = {}
            for source in sources:
                values = []
                for s in self.seeds:
                    if key in s["methods"]:
                        mask = s["test_sources"] == source
                        values.append(auroc(s["test_labels"][mask], s["methods"][key]["test_scores"][mask]))
                per_source[source] = mean_sd(values)
            out[key] = per_source
        return out


def _method_table(config: TrainConfig, have_texts: bool, have_recent2: bool = True) -> dict[str, Method]:
    other = "linear" if config.head == "mlp" else "mlp"
    h = config.head
    methods = [
        Method("length_turn", "Length + turn (LR)", "control"),
        Method("last_tool", "Last tool type (LR)", "control"),
        Method("metadata", "Length + turn + tool type (LR)", "control"),
    ]
    if have_texts:
        methods.append(Method("tfidf", "Recent2 TF-IDF (LR)", "control"))
    methods.append(Method(f"full_{h}", f"Hidden, full context, {h} (teacher)", "hidden"))
    if config.ablations:
        methods.append(Method(f"full_{other}", f"Hidden, full context, {other}", "hidden"))
    if have_recent2:
        if config.ablations:
            methods.append(Method(f"recent2_{h}", f"Hidden, Recent2, {h}", "hidden"))
        methods.append(Method(f"recent2_{h}_kd", f"Hidden, Recent2, {h} + decision KD (student)", "hidden"))
        methods.append(Method(f"recent2_{h}_kd@full", "Student applied to full-context states", "hidden"))
    return {m.key: m for m in methods}


def target_labels(meta: Sequence[Mapping[str, Any]], target: str) -> np.ndarray:
    """0/1 where labelled, -1 where the label is None (or missing)."""
    out = np.full(len(meta), -1, dtype=np.int64)
    for i, row in enumerate(meta):
        value = row.get(target)
        if value is not None:
            out[i] = int(bool(value))
    return out


def _evaluate(y_val, z_val, y_test, z_test) -> dict[str, Any]:
    threshold, _val_f1 = select_threshold(y_val, z_val)
    val = binary_metrics(y_val, z_val, threshold)
    test = binary_metrics(y_test, z_test, threshold)
    return {"threshold": threshold, "val": val, "test": test, "test_scores": np.asarray(z_test, dtype=np.float64)}


def run_experiment(
    full: np.ndarray,
    recent2: np.ndarray | None,
    meta: Sequence[Mapping[str, Any]],
    config: TrainConfig | None = None,
    texts: Mapping[tuple[str, int], str] | None = None,
    log: Callable[[str], None] = print,
) -> ExperimentResult:
    """Train and evaluate everything on one set of extracted states."""
    config = config or TrainConfig()
    with torch_threads(config.threads):
        return _run_experiment(full, recent2, meta, config, texts, log)


def _run_experiment(full, recent2, meta, config: TrainConfig, texts, log) -> ExperimentResult:
    if config.target not in TARGETS:
        raise ValueError(f"target must be one of {TARGETS}, not {config.target!r}")
    if config.head not in ("mlp", "linear"):
        raise ValueError(f"head must be mlp or linear, not {config.head!r}")
    if config.export not in ("full", "student"):
        raise ValueError(f"export must be full or student, not {config.export!r}")
    started = time.monotonic()
    full = np.asarray(full, dtype=np.float32)
    if recent2 is None and config.export == "student":
        raise ValueError("export student needs Recent2 states (extracted with --inputs full,recent2)")
    recent2 = np.asarray(recent2, dtype=np.float32) if recent2 is not None else None
    if full.shape[0] != len(meta) or (recent2 is not None and recent2.shape != full.shape):
        shape = None if recent2 is None else recent2.shape
        raise ValueError(f"full {full.shape}, recent2 {shape} and {len(meta)} metadata rows disagree")

    labels = target_labels(meta, config.target)
    keep = np.flatnonzero(labels >= 0)
    if keep.size == 0:
        raise ValueError(f"no row has a {config.target} label")
    full, y = full[keep], labels[keep]
    recent2 = recent2[keep] if recent2 is not None else None
    meta = [meta[i] for i in keep]
    groups = [task_of(str(r["trajectory_id"])) for r in meta]
    held_out = np.asarray([split_of({"id": str(r["trajectory_id"])}) == "evaluation" for r in meta])
    notes: list[str] = []

    document_texts = None
    if texts:
        document_texts = [texts.get((str(r["trajectory_id"]), int(r.get("message_index", -1)))) for r in meta]
        found = sum(t is not None for t in document_texts)
        if found == 0:
            notes.append("Recent2 TF-IDF skipped: no decision point of the states matched a text.")
            document_texts = None
        else:
            if found < len(meta):
                notes.append(f"Recent2 TF-IDF: {len(meta) - found} of {len(meta)} rows had no text (empty document).")
            document_texts = [t or "" for t in document_texts]
    else:
        notes.append(
            "Recent2 TF-IDF skipped: no texts (pass --texts JSONL or --trajectories with the source trajectories)."
        )
    methods = _method_table(config, document_texts is not None, recent2 is not None)
    corpus = TfidfCorpus(document_texts) if document_texts is not None else None

    sources = Counter(str(r.get("source", "?")) for r in meta)
    data = {
        "rows": len(labels),
        "labelled": int(keep.size),
        "positives": int(y.sum()),
        "positive_rate": float(y.mean()),
        "trajectories": len({str(r["trajectory_id"]) for r in meta}),
        "tasks": len(set(groups)),
        "hidden_size": int(full.shape[1]),
        "truncated": int(sum(bool(r.get("truncated")) for r in meta)),
        "annotators": sorted({str(r.get("annotator") or "reference") for r in meta}),  # the labelled rows
        "sources": {
            s: {
                "rows": n,
                "positive_rate": float(np.mean([y[i] for i, r in enumerate(meta) if str(r.get("source", "?")) == s])),
            }
            for s, n in sorted(sources.items())
        },
    }
    log(
        f"[train] target={config.target}: {data['labelled']} labelled rows of {data['rows']} "
        f"({data['positive_rate']:.1%} positive), {data['trajectories']} trajectories, {data['tasks']} tasks, "
        f"d={data['hidden_size']}"
    )

    length_turn = length_turn_features(meta)
    result = ExperimentResult(config=config, data=data, methods=methods, notes=notes)
    h = config.head
    other = "linear" if h == "mlp" else "mlp"
    fit_kwargs: dict[str, Any] = {
        k: getattr(config, k) for k in ("epochs", "lr", "batch_size", "weight_decay", "hidden")
    }

    for seed in config.seeds:
        t0 = time.monotonic()
        if config.held_out:
            train, val, test = held_out_split(groups, held_out, seed, config.fractions[1])
        else:
            train, val, test = grouped_split(groups, seed, config.fractions)
        n_pos = int(y[train].sum())
        n_neg = int(train.size - n_pos)
        if n_pos == 0 or n_neg == 0:
            raise ValueError(f"seed {seed}: the train split has {n_pos} positives and {n_neg} negatives")
        rho = n_neg / n_pos
        y_t = {name: torch.from_numpy(y[idx]) for name, idx in (("train", train), ("val", val), ("test", test))}
        seed_out: dict[str, Any] = {
            "seed": seed,
            "rho": rho,
            "sizes": {"train": int(train.size), "val": int(val.size), "test": int(test.size)},
            "tasks": {
                "train": len({groups[i] for i in train}),
                "val": len({groups[i] for i in val}),
                "test": len({groups[i] for i in test}),
            },
            "test_positive_rate": float(y[test].mean()) if test.size else float("nan"),
            "test_labels": y[test].copy(),
            "test_sources": np.asarray([str(meta[i].get("source", "?")) for i in test], dtype=object),
            "test_groups": np.asarray([groups[i] for i in test], dtype=object),
            "methods": {},
        }
        record = seed_out["methods"]

        # --- controls
        x = length_turn
        std = Standardizer.fit(x[train])
        predict = fit_logistic(std(x[train]).double().numpy(), y[train], rho)
        record["length_turn"] = _evaluate(
            y[val], predict(std(x[val]).double().numpy()), y[test], predict(std(x[test]).double().numpy())
        )
        tools = sorted({str(meta[i].get("last_tool") or "<none>") for i in train})
        onehot = tool_one_hot(meta, tools)
        predict = fit_logistic(onehot[train], y[train], rho)
        record["last_tool"] = _evaluate(y[val], predict(onehot[val]), y[test], predict(onehot[test]))
        x = np.concatenate([std(length_turn).double().numpy(), onehot], axis=1)
        predict = fit_logistic(x[train], y[train], rho)
        record["metadata"] = _evaluate(y[val], predict(x[val]), y[test], predict(x[test]))
        if corpus is not None:
            m_train, m_val, m_test = corpus.matrices(train, (val, test), max_features=config.tfidf_max_features)
            predict = fit_logistic(m_train, y[train], rho)
            record["tfidf"] = _evaluate(y[val], predict(m_val), y[test], predict(m_test))

        # --- hidden-state heads
        def standardizer(states: np.ndarray) -> Standardizer:
            return Standardizer.fit(states[train]) if config.standardize else Standardizer.identity(states.shape[1])

        splits = (("train", train), ("val", val), ("test", test))
        std_full = standardizer(full)
        std_recent = standardizer(recent2) if recent2 is not None else std_full
        xf = {name: std_full(full[idx]) for name, idx in splits}
        xr = {name: std_recent(recent2[idx]) for name, idx in splits} if recent2 is not None else None

        def train_head(xs, kind, teacher=None) -> FittedHead:
            head, epoch, loss = fit_head(
                xs["train"],
                y_t["train"],
                xs["val"],
                y_t["val"],
                kind=kind,
                rho=rho,
                seed=seed,
                teacher_train=teacher,
                distill_weight=config.distill_weight,
                **fit_kwargs,
            )
            return FittedHead(head, std_full if xs is xf else std_recent, epoch, loss)

        def scores(fitted: FittedHead, xs) -> tuple[np.ndarray, np.ndarray]:
            with torch.no_grad():
                return fitted.head(xs["val"]).double().numpy(), fitted.head(xs["test"]).double().numpy()

        fitted: dict[str, FittedHead] = {}
        fitted[f"full_{h}"] = teacher = train_head(xf, h)
        if config.ablations:
            fitted[f"full_{other}"] = train_head(xf, other)
        if xr is not None:
            if config.ablations:
                fitted[f"recent2_{h}"] = train_head(xr, h)
            with torch.no_grad():
                q_train = torch.sigmoid(teacher.head(xf["train"]))
            fitted[f"recent2_{h}_kd"] = train_head(xr, h, teacher=q_train)
        for key, model in fitted.items():
            z_val, z_test = scores(model, xr if key.startswith("recent2") else xf)
            record[key] = _evaluate(y[val], z_val, y[test], z_test)
            record[key]["best_epoch"] = model.best_epoch
        if xr is not None:  # the student on the states the server captures (full context), as exported
            student, kd = fitted[f"recent2_{h}_kd"], record[f"recent2_{h}_kd"]
            z_val, z_test = student.logits(full[val]), student.logits(full[test])
            record[f"recent2_{h}_kd@full"] = {
                "threshold": kd["threshold"],
                "val": binary_metrics(y[val], z_val, kd["threshold"]),
                "test": binary_metrics(y[test], z_test, kd["threshold"]),
                "test_scores": z_test,
            }
        # decision agreement with the teacher on test (eq. 24)
        teacher_decision = record[f"full_{h}"]["test_scores"] > record[f"full_{h}"]["threshold"]
        for key in (f"recent2_{h}_kd", f"recent2_{h}"):
            if key in record:
                mine = record[key]["test_scores"] > record[key]["threshold"]
                record[key]["agreement"] = float(np.mean(mine == teacher_decision)) if test.size else float("nan")

        export_key = f"full_{h}" if config.export == "full" else f"recent2_{h}_kd"
        result.export_method = export_key
        result.exported.append(export_head(fitted[export_key], config.hidden))
        result.thresholds.append(record[export_key]["threshold"])
        result.seeds.append(seed_out)
        log(
            f"[train] seed {seed}: train/val/test {train.size}/{val.size}/{test.size} rows, rho={rho:.2f}; test AUROC "
            + ", ".join(f"{k}={record[k]['test']['auroc']:.3f}" for k in methods if k in record)
            + f" ({time.monotonic() - t0:.1f} s)"
        )
    result.seconds = time.monotonic() - started
    return result
