"""Fit the metadata control as a trigger the server can run (``vllm-pamer
train-control``; served by ``band_vote: control``,
``core/policies/pamer/control_vote.py``): a class-weighted logistic
regression on length, progress and the last tool, on the labelled decision
points of the tuning split, its features made by the same function the
server calls. No engine: the labels come from ``vllm-pamer annotate``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from vllm_pamer.core.blocks import split_conversation
from vllm_pamer.core.policies.pamer.control_vote import ControlTrigger, feature_vector, request_features
from vllm_pamer.training.annotate import DecisionPoint
from vllm_pamer.training.controls import logistic_weights
from vllm_pamer.training.metrics import auroc


def point_features(
    trajectories: Sequence[Mapping[str, Any]], points: Sequence[DecisionPoint], target: str, n_recent: int
) -> tuple[list[dict[str, float | str]], np.ndarray, list[str]]:
    """Features, labels and sources of the points labelled for ``target``
    (``compression`` or ``recall``) of the given trajectories (the points of
    others are left out: a split), each request ``messages[:message_index]``
    read whole, as the server reads it. Labels that name a trajectory twice,
    a point that is no decision point, or tokens of another counter than
    ``annotate --tokens chars`` (the control's own count) are refused."""
    by_id: dict[str, list[dict[str, Any]]] = {}
    for t in trajectories:
        if str(t.get("id", "")) in by_id:
            raise ValueError(f"trajectory {t.get('id')!r} is given twice")
        by_id[str(t.get("id", ""))] = list(t["messages"])
    features, labels, sources = [], [], []
    for point in points:
        label = getattr(point, target)
        messages = by_id.get(point.trajectory_id)
        if label is None or messages is None:
            continue
        if not 0 < point.message_index < len(messages) or messages[point.message_index].get("role") != "assistant":
            raise ValueError(f"{point.trajectory_id} message {point.message_index} is no decision point")
        request = messages[: point.message_index]
        conversation = split_conversation(request)
        row = request_features(conversation.prefix, conversation.blocks, request, n_recent)
        if row["old_tokens"] != point.old_tokens:
            raise ValueError(
                f"{point.trajectory_id} message {point.message_index}: the labels count {point.old_tokens} old "
                f"tokens, the control {row['old_tokens']:.0f}: label with annotate --tokens chars and the same "
                "--n-recent"
            )
        features.append(row)
        labels.append(int(label))
        sources.append(point.source)
    return features, np.asarray(labels, dtype=np.int64), sources


def fit_control_trigger(
    features: Sequence[dict[str, float | str]], labels: np.ndarray, n_recent: int, trained_on: str, l2: float = 1.0
) -> ControlTrigger:
    """The class-weighted fit (``rho = N-/N+``, boundary at logit 0) over the
    points' standardized features; tools seen fewer than twice are not one-hot columns."""
    tool_counts: dict[str, int] = {}
    for row in features:
        tool_counts[str(row["last_tool"])] = tool_counts.get(str(row["last_tool"]), 0) + 1
    tools = sorted(t for t, n in tool_counts.items() if n >= 2)
    x = np.asarray([feature_vector(row, tools) for row in features], dtype=np.float64)
    n_pos = int(labels.sum())
    if n_pos == 0 or n_pos == len(labels):
        raise ValueError(f"the control needs both classes, got {n_pos} positive of {len(labels)}")
    mean, scale = x.mean(axis=0), x.std(axis=0)
    scale = np.where(scale > 0, scale, 1.0)
    weights, bias = logistic_weights((x - mean) / scale, labels, (len(labels) - n_pos) / n_pos, l2)
    return ControlTrigger(
        tools=tools,
        mean=mean.tolist(),
        scale=scale.tolist(),
        weights=weights.tolist(),
        bias=bias,
        n_recent=n_recent,
        trained_on=trained_on,
    )


def score_table(
    trigger: ControlTrigger, features: Sequence[dict[str, float | str]], labels: np.ndarray, sources: Sequence[str]
) -> dict[str, dict[str, float]]:
    """Per source and all: points, positive share, AUROC of the logit, and the
    share of points where the trigger says compress."""
    logits = np.asarray([trigger.logit(row) for row in features])
    fires = logits >= trigger.threshold
    source_array = np.asarray(sources, dtype=object)
    table = {}
    for name in [*sorted(set(sources)), "all"]:
        mask = np.ones(len(labels), dtype=bool) if name == "all" else source_array == name
        table[name] = {
            "points": int(mask.sum()),
            "positive": float(labels[mask].mean()) if mask.any() else float("nan"),
            "auroc": auroc(labels[mask], logits[mask]) if mask.any() else float("nan"),
            "fires": float(fires[mask].mean()) if mask.any() else float("nan"),
        }
    return table
