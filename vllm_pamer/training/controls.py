"""The observable controls the hidden-state heads are measured against
(PaMER paper, Table 1 and Table 7): class-weighted logistic regressions on
context length and turn, on the last tool type, on both, and on the Recent2
text (TF-IDF), with the texts that control reads."""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vllm_pamer.training.probes import weighted_bce

# --------------------------------------------------------------------------------------
# Texts of the decision points (the TF-IDF control)
# --------------------------------------------------------------------------------------


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
# Features and the logistic regression
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


def _logits(features, w: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if isinstance(features, torch.Tensor) and features.is_sparse:
        return torch.sparse.mm(features, w[:, None]).squeeze(1) + b
    if not isinstance(features, torch.Tensor):
        features = torch.from_numpy(np.asarray(features, dtype=np.float64))
    return features @ w + b


def logistic_weights(
    x_train, y_train: np.ndarray, rho: float, l2: float = 1.0, max_iter: int = 200
) -> tuple[np.ndarray, float]:
    """Class-weighted logistic regression (L-BFGS, float64): its weights and
    bias. ``x_train`` dense numpy or a torch sparse COO matrix; the penalty is
    ``l2/2 ||w||^2`` on the summed loss (scikit-learn's C = 1/l2), the bias is
    not penalized."""
    sparse = isinstance(x_train, torch.Tensor) and x_train.is_sparse
    x = x_train if sparse else torch.from_numpy(np.asarray(x_train, dtype=np.float64))
    y = torch.from_numpy(np.asarray(y_train, dtype=np.float64))
    n, d = x.shape
    w = torch.zeros(d, dtype=torch.float64, requires_grad=True)
    b = torch.zeros((), dtype=torch.float64, requires_grad=True)
    optimizer = torch.optim.LBFGS([w, b], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe")

    def closure():
        optimizer.zero_grad()
        loss = weighted_bce(_logits(x, w, b), y, rho) + 0.5 * l2 * (w * w).sum() / n
        loss.backward()
        return loss

    optimizer.step(closure)
    return w.detach().numpy(), float(b.detach())


def fit_logistic(
    x_train, y_train: np.ndarray, rho: float, l2: float = 1.0, max_iter: int = 200
) -> Callable[[Any], np.ndarray]:
    """``logistic_weights`` as a function mapping features (dense or sparse, as
    trained) to logits."""
    w, b = logistic_weights(x_train, y_train, rho, l2, max_iter)
    weights, bias = torch.from_numpy(w), torch.tensor(b, dtype=torch.float64)
    return lambda features: _logits(features, weights, bias).numpy()


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
                    torch.from_numpy(np.stack([r, c])),
                    torch.from_numpy(v),
                    (len(rows_wanted), max(1, keep.size)),
                    dtype=torch.float64,
                    check_invariants=False,
                ).coalesce()
            )
        return out
