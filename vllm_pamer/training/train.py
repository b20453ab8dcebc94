"""``vllm-pamer train``: fit the five compression heads and measure them against
observable controls (paper §3.1-3.4, Appendix A.2-A.4 and B.2).

Input: a directory of extracted states (``vllm_pamer.training.extract``), shards
``states-XXXXX.safetensors`` (``full`` [n, d] = final-norm state of the last
token of the full served context, ``recent2`` [n, d] = the same for the compact
``P + R_t`` input) with one metadata dict per row in ``states-XXXXX.jsonl``
(trajectory_id, source, step, message_index, full_tokens, recent2_tokens,
truncated, turn, last_tool, recall, compression). ``read_states`` here reads
that format without importing the extractor.

Protocol, per seed s in 0..4 (the seed fixes both the split and the init):

* rows whose target label is None are dropped; the rest are split 70/15/15 by
  *task* (``task_id``: ``airline-task14-trial3`` -> ``airline-task14``; any
  other id is its own task), so every trial of a task lies in one split;
* inputs are standardized with train-split statistics (folded into the
  exported weights, so the served heads read raw states);
* heads (linear ``w.h + b`` or MLP ``w2 . GELU(W1 h + b1) + b2``, width 256,
  exact-erf GELU as ``kernels.five_head_vote_reference``) are trained with
  AdamW (lr 1e-3, batch 256, 50 epochs) on class-weighted BCE with
  ``rho = N-/N+`` of the train split (eq. 4); the checkpoint is the epoch with
  the lowest validation label loss (WBCE);
* the teacher is the head on full-context states; the student reads Recent2
  states and adds decision distillation ``0.5 * BCEWithLogits(z, sigmoid(teacher))``
  (eq. 25), the teacher scoring the same decision points;
* each method's threshold is the validation-F1-best one (eq. 14), then fixed
  for the test split; AUROC (primary), AUPRC and F1 are measured on test;
* controls on the same splits: logistic regressions on length + turn, last
  tool type, length + turn + tool type, and Recent2 TF-IDF when texts exist.

Output: the heads file (one head per seed, thresholds in logit space,
``trained=True``, ``min_votes=3``) and, with ``--report DIR``, ``report.md``,
``results.json``, ``roc.png`` and ``auroc.png`` (``train_report.py``); with ``--layer-states DIR``
(an ``extract --layers`` run) also the depth diagnostic of ``layerwise.py``.

Which heads are exported (``--export``): the server evaluates the heads on the
state captured at the prefill of the *served* request, which is the full
(effective) context, not a separate ``P + R_t`` pass. ``full`` (default)
exports the heads trained on full-context states, the distribution the server
feeds them; ``student`` exports the Recent2 distillation students as the paper
deploys them (its extractor reads ``P + R_t``). The report measures the
student on full-context states too, to show what the mismatch costs.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from vllm_pamer.training.metrics import auroc, binary_metrics, mean_sd, select_threshold

TARGETS = ("compression", "recall")
HIDDEN_WIDTH = 256
NUM_SEEDS = 5

# --------------------------------------------------------------------------------------
# Reading the extracted states
# --------------------------------------------------------------------------------------


def read_states(
    directory: str | Path, allow_partial: bool = False
) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """All shards of an extracted-states directory, in shard order:
    ``(full [n, d] float32, recent2 [n, d] float32, metadata rows)``.

    A shard is complete when both its files exist (the extractor renames the
    JSON lines last). When the directory has the extractor's ``manifest.json``,
    fewer complete shards than it plans is an error unless ``allow_partial``."""
    from safetensors.numpy import load_file

    directory = Path(directory)
    shards = sorted(directory.glob("states-*.safetensors"))
    complete = [s for s in shards if s.with_suffix(".jsonl").is_file()]
    manifest = directory / "manifest.json"
    planned = None
    if manifest.is_file():
        try:
            planned = int(json.loads(manifest.read_text())["shards"])
        except (ValueError, KeyError, TypeError):
            planned = None
    if not allow_partial and (len(complete) < len(shards) or (planned is not None and len(complete) < planned)):
        raise ValueError(
            f"{directory}: {len(complete)} complete shards of {planned if planned is not None else len(shards)} "
            "(finish vllm-pamer extract, or pass --allow-partial)"
        )
    if not complete:
        raise FileNotFoundError(f"no complete states-*.safetensors shards in {directory}")
    fulls, recents, meta = [], [], []
    for shard in complete:
        tensors = load_file(str(shard))
        for name in ("full", "recent2"):
            if name not in tensors:
                raise ValueError(f"{shard}: missing tensor {name!r} (has {sorted(tensors)})")
        full, recent2 = tensors["full"], tensors["recent2"]
        if full.shape != recent2.shape or full.ndim != 2:
            raise ValueError(f"{shard}: full {full.shape} and recent2 {recent2.shape} must be equal [n, d]")
        sidecar = shard.with_suffix(".jsonl")
        rows = [json.loads(line) for line in sidecar.read_text().splitlines() if line.strip()]
        if len(rows) != full.shape[0]:
            raise ValueError(f"{shard}: {full.shape[0]} state rows but {len(rows)} metadata rows")
        fulls.append(full.astype(np.float32, copy=False))
        recents.append(recent2.astype(np.float32, copy=False))
        meta.extend(rows)
    d = {f.shape[1] for f in fulls}
    if len(d) != 1:
        raise ValueError(f"shards disagree on the hidden size: {sorted(d)}")
    return np.concatenate(fulls), np.concatenate(recents), meta


def read_texts(path: str | Path) -> dict[tuple[str, int], str]:
    """``--texts`` JSONL: ``{"trajectory_id", "message_index", "text"}`` per
    decision point (the Recent2 ``P + R_t`` text) -> {(id, index): text}."""
    texts: dict[tuple[str, int], str] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            texts[(str(row["trajectory_id"]), int(row["message_index"]))] = str(row.get("text") or "")
    return texts


def recent2_texts(trajectories: Iterable[Mapping[str, Any]], n_recent: int = 2) -> dict[tuple[str, int], str]:
    """The plain-text ``P + R_t`` of every decision point of the trajectories
    (the same P / O / R split as the annotator; ``serialize_messages`` text),
    for the TF-IDF control when no ``--texts`` file exists."""
    from vllm_pamer.core.text import serialize_messages
    from vllm_pamer.training.annotate import AnnotatorSettings, decision_contexts

    settings = AnnotatorSettings(n_recent=n_recent)
    texts: dict[tuple[str, int], str] = {}
    for trajectory in trajectories:
        messages = list(trajectory["messages"])
        # token counts do not move the P / O / R boundaries: count nothing
        for ctx in decision_contexts(trajectory, lambda _messages: 0, settings):
            chosen = messages[: ctx.prefix_end] + messages[ctx.old_end : ctx.message_index]
            texts[(str(trajectory["id"]), ctx.message_index)] = serialize_messages(chosen)
    return texts


# --------------------------------------------------------------------------------------
# Grouped splits
# --------------------------------------------------------------------------------------

_TRIAL_RE = re.compile(r"^(?P<task>.+)-trial\d+$")


def task_id(trajectory_id: str) -> str:
    """The grouping unit: tau-bench ``airline-task14-trial1`` -> ``airline-task14``
    (all trials of a task together); any other id (mini-swe) is its own task."""
    match = _TRIAL_RE.match(trajectory_id)
    return match.group("task") if match else trajectory_id


def grouped_split(
    groups: Sequence[str], seed: int, fractions: tuple[float, float, float] = (0.7, 0.15, 0.15)
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Row indices (train, val, test) with every group in exactly one split.

    The sorted distinct groups are shuffled by ``numpy.random.default_rng(seed)``
    and cut by *group count*: round(0.70 G) train, round(0.15 G) val, the rest
    test (each split gets at least one group when G >= 3). Deterministic per seed."""
    groups = np.asarray(groups, dtype=object)
    distinct = sorted(set(groups.tolist()))
    g = len(distinct)
    if g < 3:
        raise ValueError(f"need at least 3 tasks to split 70/15/15, got {g}")
    if not math.isclose(sum(fractions), 1.0):
        raise ValueError(f"fractions must sum to 1: {fractions}")
    order = np.random.default_rng(seed).permutation(g)
    n_train = min(max(1, round(fractions[0] * g)), g - 2)
    n_val = min(max(1, round(fractions[1] * g)), g - n_train - 1)
    index = {distinct[k]: rank for rank, k in enumerate(order)}
    rank = np.fromiter((index[x] for x in groups), dtype=np.int64, count=len(groups))
    train = np.flatnonzero(rank < n_train)
    val = np.flatnonzero((rank >= n_train) & (rank < n_train + n_val))
    test = np.flatnonzero(rank >= n_train + n_val)
    return train, val, test


# --------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------


def weighted_bce(z: torch.Tensor, y: torch.Tensor, rho: float) -> torch.Tensor:
    """Class-weighted BCE on logits (eq. 4 / 16), mean over rows:
    ``(rho y + 1 - y) softplus(z) - rho y z`` = ``-[rho y log p + (1-y) log(1-p)]``."""
    y = y.to(z.dtype)
    return ((rho * y + 1.0 - y) * F.softplus(z) - rho * y * z).mean()


def distillation_loss(
    z: torch.Tensor, y: torch.Tensor, q: torch.Tensor, rho: float, weight: float = 0.5
) -> torch.Tensor:
    """Decision distillation (eq. 25): ``WBCE(z, y) + weight * BCEWithLogits(z, q)``,
    ``q`` the teacher's probability on the same rows."""
    return weighted_bce(z, y, rho) + weight * F.binary_cross_entropy_with_logits(z, q.to(z.dtype))


# --------------------------------------------------------------------------------------
# Heads
# --------------------------------------------------------------------------------------


class ProbeHead(torch.nn.Module):
    """``linear``: ``x . w + b``; ``mlp``: ``GELU(x @ w1 + b1) . w2 + b2``
    (exact-erf GELU, the layout of the heads file: w1 [d, W])."""

    def __init__(self, d: int, kind: str = "mlp", hidden: int = HIDDEN_WIDTH) -> None:
        super().__init__()
        if kind not in ("linear", "mlp"):
            raise ValueError(f"head kind must be linear or mlp, not {kind!r}")
        self.kind = kind
        bound = 1.0 / math.sqrt(d)  # torch.nn.Linear's default init
        if kind == "linear":
            self.w = torch.nn.Parameter(torch.empty(d).uniform_(-bound, bound))
            self.b = torch.nn.Parameter(torch.empty(()).uniform_(-bound, bound))
        else:
            self.w1 = torch.nn.Parameter(torch.empty(d, hidden).uniform_(-bound, bound))
            self.b1 = torch.nn.Parameter(torch.empty(hidden).uniform_(-bound, bound))
            bound2 = 1.0 / math.sqrt(hidden)
            self.w2 = torch.nn.Parameter(torch.empty(hidden).uniform_(-bound2, bound2))
            self.b2 = torch.nn.Parameter(torch.empty(()).uniform_(-bound2, bound2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "linear":
            return x @ self.w + self.b
        return F.gelu(x @ self.w1 + self.b1) @ self.w2 + self.b2


@dataclass
class Standardizer:
    """``(x - mean) / scale`` with train-split statistics (scale 1 for constant dims)."""

    mean: np.ndarray
    scale: np.ndarray

    @classmethod
    def fit(cls, x: np.ndarray) -> "Standardizer":
        x64 = x.astype(np.float64)
        mean = x64.mean(axis=0)
        scale = x64.std(axis=0)
        scale = np.where(scale > 1e-6, scale, 1.0)
        return cls(mean=mean, scale=scale)

    @classmethod
    def identity(cls, d: int) -> "Standardizer":
        return cls(mean=np.zeros(d), scale=np.ones(d))

    def __call__(self, x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((x - self.mean) / self.scale).astype(np.float32))


@dataclass
class FittedHead:
    head: ProbeHead
    standardizer: Standardizer
    best_epoch: int
    best_val_loss: float

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Logits on raw states (standardized here)."""
        with torch.no_grad():
            return self.head(self.standardizer(x)).double().numpy()


def fit_head(
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_val: torch.Tensor,
    y_val: torch.Tensor,
    *,
    kind: str,
    rho: float,
    seed: int,
    teacher_train: torch.Tensor | None = None,
    distill_weight: float = 0.5,
    epochs: int = 50,
    lr: float = 1e-3,
    batch_size: int = 256,
    weight_decay: float = 0.01,
    hidden: int = HIDDEN_WIDTH,
) -> tuple[ProbeHead, int, float]:
    """Train one head on (already standardized) inputs; keep the epoch with the
    lowest validation label loss (WBCE, without the distillation term).
    Returns (head at its best epoch, best epoch (1-based), best val loss)."""
    torch.manual_seed(seed)
    head = ProbeHead(x_train.shape[1], kind, hidden)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    y_train = y_train.float()
    y_val = y_val.float()
    n = x_train.shape[0]
    best_loss, best_epoch = math.inf, 0
    best_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    for epoch in range(1, epochs + 1):
        head.train()
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            z = head(x_train[idx])
            if teacher_train is None:
                loss = weighted_bce(z, y_train[idx], rho)
            else:
                loss = distillation_loss(z, y_train[idx], teacher_train[idx], rho, distill_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            val_loss = float(weighted_bce(head(x_val), y_val, rho)) if len(y_val) else float(loss)
        if val_loss < best_loss:
            best_loss, best_epoch = val_loss, epoch
            best_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    head.load_state_dict(best_state)
    head.eval()
    return head, best_epoch, best_loss


def export_head(fitted: FittedHead, hidden: int = HIDDEN_WIDTH) -> dict[str, np.ndarray]:
    """One head in the heads-file layout (w1 [d, W], b1 [W], w2 [W], b2 []),
    reading *raw* states: the standardization is folded into w1 / b1.

    A linear head becomes an exact MLP through ``GELU(a) - GELU(-a) = a``:
    hidden unit 0 computes ``a = w.x``, unit 1 ``-a``, ``w2 = (1, -1, 0, ...)``."""
    head, std = fitted.head, fitted.standardizer
    inv = 1.0 / std.scale
    shift = std.mean * inv  # x_std = x * inv - shift
    if head.kind == "mlp":
        w1 = head.w1.detach().double().numpy()
        b1 = head.b1.detach().double().numpy()
        w1_raw = w1 * inv[:, None]
        b1_raw = b1 - shift @ w1
        w2 = head.w2.detach().double().numpy()
        b2 = float(head.b2.detach())
    else:
        w = head.w.detach().double().numpy() * inv
        d = w.shape[0]
        w1_raw = np.zeros((d, hidden))
        w1_raw[:, 0], w1_raw[:, 1] = w, -w
        b1_raw = np.zeros(hidden)
        w2 = np.zeros(hidden)
        w2[0], w2[1] = 1.0, -1.0
        b2 = float(head.b.detach()) - float(shift @ (head.w.detach().double().numpy()))
    return {
        "w1": w1_raw.astype(np.float32),
        "b1": b1_raw.astype(np.float32),
        "w2": w2.astype(np.float32),
        "b2": np.float32(b2),
    }


def stack_heads(exported: Sequence[Mapping[str, Any]], thresholds: Sequence[float], fingerprint, min_votes: int = 3):
    """Five exported heads + logit thresholds -> ``vllm_pamer.core.heads.Heads``."""
    from vllm_pamer.core.heads import NUM_HEADS, Heads

    if len(exported) != NUM_HEADS:
        raise ValueError(f"the heads file holds {NUM_HEADS} heads, got {len(exported)} (one per seed)")
    return Heads(
        w1=np.stack([e["w1"] for e in exported]).astype(np.float32),
        b1=np.stack([e["b1"] for e in exported]).astype(np.float32),
        w2=np.stack([e["w2"] for e in exported]).astype(np.float32),
        b2=np.asarray([e["b2"] for e in exported], dtype=np.float32),
        thresholds=np.asarray(thresholds, dtype=np.float32),
        fingerprint=fingerprint,
        min_votes=min_votes,
        trained=True,
    )


# --------------------------------------------------------------------------------------
# Observable controls (logistic regression)
# --------------------------------------------------------------------------------------


def _num(row: Mapping[str, Any], *keys: str) -> float:
    """The first present key's value (0 when none is)."""
    for key in keys:
        value = row.get(key)
        if value is not None:
            return float(value)
    return 0.0


LENGTH_TURN_FEATURES = (
    (("context_tokens", "full_tokens"), 1000.0),
    (("recent2_context_tokens", "recent2_tokens"), 1000.0),
    (("old_tokens",), 1000.0),
    (("turn",), 1.0),
    (("step",), 1.0),
)


def length_turn_features(meta: Sequence[Mapping[str, Any]]) -> np.ndarray:
    """Context length and interaction progress, each raw and log1p: tokens of the
    full context (before any probe cut) and of the Recent2 input, tokens(O_t),
    user turns and agent steps (``turn`` is 1 for one-instruction agents, so
    the step count carries their progress). A missing field is a 0 column."""
    columns = []
    for keys, scale in LENGTH_TURN_FEATURES:
        v = np.asarray([_num(r, *keys) for r in meta], dtype=np.float64)
        columns += [np.log1p(np.maximum(v, 0.0)), v / scale]
    return np.stack(columns, axis=1)


def tool_one_hot(meta: Sequence[Mapping[str, Any]], vocabulary: Sequence[str]) -> np.ndarray:
    index = {name: k for k, name in enumerate(vocabulary)}
    out = np.zeros((len(meta), len(vocabulary)))
    for i, row in enumerate(meta):
        k = index.get(str(row.get("last_tool") or "<none>"))
        if k is not None:
            out[i, k] = 1.0
    return out


def fit_logistic(
    x_train, y_train: np.ndarray, rho: float, l2: float = 1.0, max_iter: int = 200
) -> Callable[[Any], np.ndarray]:
    """Class-weighted logistic regression (L-BFGS, float64). ``x_*`` dense numpy
    or a torch sparse COO matrix; the penalty is ``l2/2 ||w||^2`` on the summed
    loss (scikit-learn's C = 1/l2), the bias is not penalized. Returns a function
    mapping features to logits."""
    sparse = isinstance(x_train, torch.Tensor) and x_train.is_sparse
    x = x_train if sparse else torch.from_numpy(np.asarray(x_train, dtype=np.float64))
    y = torch.from_numpy(np.asarray(y_train, dtype=np.float64))
    n, d = x.shape
    w = torch.zeros(d, dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")

    def logits(features) -> torch.Tensor:
        if isinstance(features, torch.Tensor) and features.is_sparse:
            return torch.sparse.mm(features, w[:, None]).squeeze(1) + b
        if not isinstance(features, torch.Tensor):
            features = torch.from_numpy(np.asarray(features, dtype=np.float64))
        return features @ w + b

    def closure():
        optimizer.zero_grad()
        loss = weighted_bce(logits(x), y, rho) + 0.5 * l2 * (w * w).sum() / n
        loss.backward()
        return loss

    optimizer.step(closure)

    def predict(features) -> np.ndarray:
        with torch.no_grad():
            return logits(features).numpy()

    return predict


_TOKEN_RE = re.compile(r"(?u)\b\w\w+\b")


class TfidfCorpus:
    """Counts of every document once; per split, TF-IDF on the train split's
    vocabulary (scikit-learn defaults: lowercase ``\\b\\w\\w+\\b`` unigrams, raw
    counts, smooth idf ``ln((1+n)/(1+df)) + 1``, rows L2-normalized), keeping
    the ``max_features`` most frequent train terms with df >= ``min_df``."""

    def __init__(self, documents: Sequence[str]) -> None:
        vocabulary: dict[str, int] = {}
        rows, cols, vals = [], [], []
        for i, text in enumerate(documents):
            counts = Counter(_TOKEN_RE.findall(text.lower()))
            for term, count in counts.items():
                rows.append(i)
                cols.append(vocabulary.setdefault(term, len(vocabulary)))
                vals.append(count)
        self.n_docs = len(documents)
        self.n_terms = len(vocabulary)
        self.rows = np.asarray(rows, dtype=np.int64)
        self.cols = np.asarray(cols, dtype=np.int64)
        self.vals = np.asarray(vals, dtype=np.float64)

    def matrices(
        self, train: np.ndarray, others: Sequence[np.ndarray], min_df: int = 2, max_features: int = 20000
    ) -> list[torch.Tensor]:
        """Sparse TF-IDF matrices for ``train`` then each of ``others`` (row index arrays)."""
        in_train = np.zeros(self.n_docs, dtype=bool)
        in_train[train] = True
        mask = in_train[self.rows]
        df = np.bincount(self.cols[mask], minlength=self.n_terms)
        total = np.bincount(self.cols[mask], weights=self.vals[mask], minlength=self.n_terms)
        eligible = np.flatnonzero(df >= min_df)
        keep = eligible[np.argsort(-total[eligible], kind="mergesort")[:max_features]]
        column = np.full(self.n_terms, -1, dtype=np.int64)
        column[keep] = np.arange(keep.size)
        idf = np.log((1.0 + len(train)) / (1.0 + df)) + 1.0
        out = []
        for rows_wanted in (train, *others):
            position = np.full(self.n_docs, -1, dtype=np.int64)
            position[rows_wanted] = np.arange(len(rows_wanted))
            sel = (position[self.rows] >= 0) & (column[self.cols] >= 0)
            r, c = position[self.rows[sel]], column[self.cols[sel]]
            v = self.vals[sel] * idf[self.cols[sel]]
            norms = np.sqrt(np.bincount(r, weights=v * v, minlength=len(rows_wanted)))
            v = v / np.where(norms > 0, norms, 1.0)[r]
            out.append(
                torch.sparse_coo_tensor(
                    torch.from_numpy(np.stack([r, c])), torch.from_numpy(v),
                    (len(rows_wanted), max(1, keep.size)), dtype=torch.float64, check_invariants=False,
                ).coalesce()
            )
        return out


# --------------------------------------------------------------------------------------
# The experiment
# --------------------------------------------------------------------------------------


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
    standardize: bool = True
    ablations: bool = True
    """Also train the other-architecture full-context head and the Recent2 head
    without distillation (Table 1 / Table 2 rows)."""
    min_votes: int = 3
    tfidf_max_features: int = 20000
    threads: int | None = 1
    """torch CPU threads while training (restored afterwards). 1 by default: on a
    shared 2-core machine two threads ran 5-10x slower than one (the thread
    pool contends with other work); None leaves torch's setting."""


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
    test labels and scores (for ROC curves)."""
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
            out[key] = {
                metric: mean_sd([m["test"][metric] for m in per_seed])
                for metric in ("auroc", "auprc", "f1")
            }
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


def _method_table(config: TrainConfig, have_texts: bool) -> dict[str, Method]:
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
        methods.append(Method(f"recent2_{h}", f"Hidden, Recent2, {h}", "hidden"))
    methods.append(Method(f"recent2_{h}_kd", f"Hidden, Recent2, {h} + decision KD (student)", "hidden"))
    methods.append(Method(f"recent2_{h}_kd@full", f"Student applied to full-context states", "hidden"))
    return {m.key: m for m in methods}


def _labels(meta: Sequence[Mapping[str, Any]], target: str) -> np.ndarray:
    """0/1 where labelled, -1 where the label is None (or missing)."""
    out = np.full(len(meta), -1, dtype=np.int64)
    for i, row in enumerate(meta):
        value = row.get(target)
        if value is not None:
            out[i] = int(bool(value))
    return out


def _evaluate(y_val, z_val, y_test, z_test) -> dict[str, Any]:
    threshold, val_f1 = select_threshold(y_val, z_val)
    val = binary_metrics(y_val, z_val, threshold)
    test = binary_metrics(y_test, z_test, threshold)
    return {"threshold": threshold, "val": val, "test": test, "test_scores": np.asarray(z_test, dtype=np.float64)}


@contextmanager
def torch_threads(threads: int | None):
    """Run a block with ``threads`` torch CPU threads (None: torch's setting),
    restoring the previous count afterwards."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def run_experiment(
    full: np.ndarray,
    recent2: np.ndarray,
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
    recent2 = np.asarray(recent2, dtype=np.float32)
    if full.shape != recent2.shape or full.shape[0] != len(meta):
        raise ValueError(f"full {full.shape}, recent2 {recent2.shape} and {len(meta)} metadata rows disagree")

    labels = _labels(meta, config.target)
    keep = np.flatnonzero(labels >= 0)
    if keep.size == 0:
        raise ValueError(f"no row has a {config.target} label")
    full, recent2, y = full[keep], recent2[keep], labels[keep]
    meta = [meta[i] for i in keep]
    groups = [task_id(str(r["trajectory_id"])) for r in meta]
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
    methods = _method_table(config, document_texts is not None)
    corpus = TfidfCorpus(document_texts) if document_texts is not None else None

    sources = Counter(str(r.get("source", "?")) for r in meta)
    data = {
        "rows": int(len(labels)),
        "labelled": int(keep.size),
        "positives": int(y.sum()),
        "positive_rate": float(y.mean()),
        "trajectories": len({str(r["trajectory_id"]) for r in meta}),
        "tasks": len(set(groups)),
        "hidden_size": int(full.shape[1]),
        "truncated": int(sum(bool(r.get("truncated")) for r in meta)),
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
        f"({data['positive_rate']:.1%} positive), {data['trajectories']} trajectories, {data['tasks']} tasks, d={data['hidden_size']}"
    )

    length_turn = length_turn_features(meta)
    result = ExperimentResult(config=config, data=data, methods=methods, notes=notes)
    h = config.head
    other = "linear" if h == "mlp" else "mlp"
    fit_kwargs = dict(
        epochs=config.epochs, lr=config.lr, batch_size=config.batch_size,
        weight_decay=config.weight_decay, hidden=config.hidden,
    )

    for seed in config.seeds:
        t0 = time.monotonic()
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
            "methods": {},
        }
        record = seed_out["methods"]

        # --- controls
        x = length_turn
        std = Standardizer.fit(x[train])
        predict = fit_logistic(std(x[train]).double().numpy(), y[train], rho)
        record["length_turn"] = _evaluate(y[val], predict(std(x[val]).double().numpy()), y[test], predict(std(x[test]).double().numpy()))
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

        std_full, std_recent = standardizer(full), standardizer(recent2)
        xf = {name: std_full(full[idx]) for name, idx in (("train", train), ("val", val), ("test", test))}
        xr = {name: std_recent(recent2[idx]) for name, idx in (("train", train), ("val", val), ("test", test))}

        def train_head(xs, kind, teacher=None) -> FittedHead:
            head, epoch, loss = fit_head(
                xs["train"], y_t["train"], xs["val"], y_t["val"], kind=kind, rho=rho, seed=seed,
                teacher_train=teacher, distill_weight=config.distill_weight, **fit_kwargs,
            )
            return FittedHead(head, std_full if xs is xf else std_recent, epoch, loss)

        def scores(fitted: FittedHead, xs) -> tuple[np.ndarray, np.ndarray]:
            with torch.no_grad():
                return fitted.head(xs["val"]).double().numpy(), fitted.head(xs["test"]).double().numpy()

        fitted: dict[str, FittedHead] = {}
        fitted[f"full_{h}"] = teacher = train_head(xf, h)
        if config.ablations:
            fitted[f"full_{other}"] = train_head(xf, other)
            fitted[f"recent2_{h}"] = train_head(xr, h)
        with torch.no_grad():
            q_train = torch.sigmoid(teacher.head(xf["train"]))
        fitted[f"recent2_{h}_kd"] = student = train_head(xr, h, teacher=q_train)
        for key, model in fitted.items():
            z_val, z_test = scores(model, xf if model.standardizer is std_full else xr)
            record[key] = _evaluate(y[val], z_val, y[test], z_test)
            record[key]["best_epoch"] = model.best_epoch
        # the student on the states the server captures (full context), its own
        # standardization and threshold, as the exported weights would run
        z_val = student.logits(full[val])
        z_test = student.logits(full[test])
        record[f"recent2_{h}_kd@full"] = {
            "threshold": record[f"recent2_{h}_kd"]["threshold"],
            "val": binary_metrics(y[val], z_val, record[f"recent2_{h}_kd"]["threshold"]),
            "test": binary_metrics(y[test], z_test, record[f"recent2_{h}_kd"]["threshold"]),
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


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def model_fingerprint(model: str | Path | None):
    """Fingerprint of ``model`` (a model directory) or of the embedded default model."""
    from vllm_pamer.core.heads import ModelFingerprint

    if model is None:
        from vllm_pamer.default_model import ensure_default_model

        model = ensure_default_model(quiet=True)
    return ModelFingerprint.from_model_dir(model)


def main(argv: Sequence[str] | None = None) -> int:
    """``vllm-pamer train``: fit the heads, write the heads file and the report."""
    parser = argparse.ArgumentParser(
        prog="vllm-pamer train",
        description="Train the five PaMER heads on extracted states and compare them with observable controls.",
    )
    parser.add_argument("--states", required=True, metavar="DIR", help="extracted states (states-XXXXX.safetensors + .jsonl)")
    parser.add_argument("--out", required=True, metavar="PATH", help="heads file to write (safetensors)")
    parser.add_argument("--report", default=None, metavar="DIR", help="write report.md, results.json and plots here")
    parser.add_argument("--target", choices=TARGETS, default="compression")
    parser.add_argument("--head", choices=("mlp", "linear"), default="mlp", help="teacher / student / exported head (default mlp)")
    parser.add_argument(
        "--export", choices=("full", "student"), default="full",
        help="export the full-context heads (what the server's captured state is; default) or the Recent2 KD students",
    )
    parser.add_argument("--model", default=None, metavar="DIR", help="model the heads are for (default: the embedded model)")
    parser.add_argument("--texts", default=None, metavar="JSONL", help="Recent2 texts {trajectory_id, message_index, text} for the TF-IDF control")
    parser.add_argument(
        "--trajectories", action="append", default=None, metavar="PATH",
        help="trajectory files (.jsonl[.gz]) to build the Recent2 texts from when --texts is absent; repeatable",
    )
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated split seeds; 5 are exported (default 0-4)")
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--distill-weight", type=float, default=0.5)
    parser.add_argument("--min-votes", type=int, default=3)
    parser.add_argument("--allow-partial", action="store_true", help="train on the complete shards of an unfinished extraction")
    parser.add_argument(
        "--layer-states", default=None, metavar="DIR",
        help="also run the depth diagnostic on a `vllm-pamer extract --layers` directory (needs --report)",
    )
    parser.add_argument("--no-standardize", action="store_true", help="train on raw states")
    parser.add_argument("--no-ablations", action="store_true", help="skip the Table 1/2 ablation heads (faster)")
    parser.add_argument(
        "--threads", type=int, default=1,
        help="torch CPU threads while training (default 1, the fastest on a shared 2-core machine; 0 = torch's default)",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
    if len(seeds) != NUM_SEEDS:
        parser.error(f"--seeds must name {NUM_SEEDS} seeds (one exported head each), got {len(seeds)}")
    if not 1 <= args.min_votes <= NUM_SEEDS:
        parser.error(f"--min-votes must be in 1..{NUM_SEEDS}")
    if args.layer_states and not args.report:
        parser.error("--layer-states writes into the report: pass --report DIR")

    fingerprint = model_fingerprint(args.model)
    full, recent2, meta = read_states(args.states, allow_partial=args.allow_partial)
    if full.shape[1] != fingerprint.hidden_size:
        sys.exit(
            f"vllm-pamer train: the states have d = {full.shape[1]} but model {fingerprint.model_name!r} has "
            f"hidden size {fingerprint.hidden_size}; pass the model the states were extracted from (--model)"
        )
    texts = None
    if args.texts:
        texts = read_texts(args.texts)
    elif args.trajectories:
        from vllm_pamer.trajectories import load_trajectories

        texts = {}
        for path in args.trajectories:
            texts.update(recent2_texts(load_trajectories(path)))

    config = TrainConfig(
        target=args.target, head=args.head, export=args.export, seeds=seeds, epochs=args.epochs, lr=args.lr,
        batch_size=args.batch_size, weight_decay=args.weight_decay, distill_weight=args.distill_weight,
        standardize=not args.no_standardize, ablations=not args.no_ablations, min_votes=args.min_votes,
        threads=args.threads or None,
    )
    result = run_experiment(full, recent2, meta, config, texts=texts)

    from vllm_pamer.core.heads import save_heads
    from vllm_pamer.training.train_report import fmt_estimate, write_report

    heads = stack_heads(result.exported, result.thresholds, fingerprint, config.min_votes)
    save_heads(heads, args.out)
    print(f"[train] wrote {args.out}: 5 heads from {result.methods[result.export_method].label}")
    summary = result.summary()
    for key, method in result.methods.items():
        if key in summary:
            s = summary[key]
            print(f"  {method.label:<48} " + "  ".join(f"{m.upper()} {fmt_estimate(s[m])}" for m in ("auroc", "auprc", "f1")))
    for note in result.notes:
        print(f"  note: {note}")
    layerwise = None
    if args.layer_states:
        from vllm_pamer.training.extract import ExtractError, load_layer_states
        from vllm_pamer.training.layerwise import run_layerwise, write_layerwise_report

        try:
            last, mean, taps, layer_meta = load_layer_states(args.layer_states, allow_partial=args.allow_partial)
        except ExtractError as exc:
            sys.exit(f"vllm-pamer train: {exc}")
        with torch_threads(config.threads):
            layerwise = run_layerwise(
                last, mean, taps, layer_meta, seeds=seeds, epochs=args.epochs,
                num_layers=fingerprint.num_hidden_layers,
            )
        path = write_layerwise_report(layerwise, args.report, inputs={"layer_states": str(args.layer_states)})
        print(f"[train] layerwise report: {path}")
    if args.report:
        inputs = {"states": str(args.states), "texts": args.texts, "trajectories": args.trajectories, "out": str(args.out)}
        path = write_report(
            result, args.report, heads_path=args.out, fingerprint=fingerprint, inputs=inputs, layerwise=layerwise
        )
        print(f"[train] report: {path}")
    print(f"[train] done in {result.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
