"""The metadata control as the band's trigger (``band_vote: control``): a
logistic regression on what a request's text alone says (its length, how far
the session has come, the last tool called), of the kind the heads are
measured against in training (``training/controls.py``: length + turn + tool
type; that one counts with the served tokenizer and is refitted per split),
put where the heads' vote decides. Issue 32's ablation (c): the heads earn
their place only if they decide better than this.

Pure: the same function makes the features of a trajectory's decision point
in training (``training/control_trigger.py``) and of a request on the server,
from the same view: the whole request as the client sent it (no memory
covers a training point, so none is subtracted on the server either).
Lengths are characters // 4 of the plain-text view (``core/text.py``), the
annotator's ``--tokens chars`` count: no tokenizer, the same on every server.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import msgspec

from vllm_pamer.core.blocks import Block, Message, last_tool, split_recent
from vllm_pamer.core.policies.base import PolicyRequest
from vllm_pamer.core.store import MemoryStore
from vllm_pamer.core.text import char_tokens
from vllm_pamer.core.view import flatten

SHIPPED_CONTROL = Path(__file__).resolve().parents[3] / "data" / "control_trigger.json"
"""The control trained on the tuning split (``vllm-pamer train-control``)."""

NUMERIC = ("context_tokens", "kept_tokens", "old_tokens", "turn", "assistant_turns")
"""The numeric features, each as log1p and value / 1000 (``feature_vector``)."""


def request_features(
    prefix: Sequence[Message], blocks: Sequence[Block], history: Sequence[Message], n_recent: int
) -> dict[str, float | str]:
    """What the control reads of a request (``prefix`` and ``blocks``: its
    split, ``history``: its messages): ``context_tokens`` of all of it,
    ``kept_tokens`` of the prefix and the ``n_recent`` newest blocks (P + R),
    ``old_tokens`` of the blocks before them (O, counted per block as the
    annotator does), ``turn`` its user messages, ``assistant_turns`` its assistant
    messages, ``last_tool`` the last tool it called."""
    old, recent = split_recent(blocks, n_recent)
    return {
        "context_tokens": float(char_tokens([*prefix, *flatten(blocks)])),
        "kept_tokens": float(char_tokens([*prefix, *flatten(recent)])),
        "old_tokens": float(sum(char_tokens(b.messages) for b in old)),  # per block, as the annotator counts
        "turn": float(sum(1 for m in history if m.get("role") == "user")),
        "assistant_turns": float(sum(1 for m in history if m.get("role") == "assistant")),
        "last_tool": last_tool(history) or "<none>",
    }


def feature_vector(features: dict[str, float | str], tools: Sequence[str]) -> list[float]:
    """log1p and value / 1000 of each numeric feature, then the last tool one-hot
    over ``tools`` (a tool outside them is all zeros)."""
    out: list[float] = []
    for name in NUMERIC:
        value = max(0.0, float(features[name]))
        out += [math.log1p(value), value / 1000.0]
    return out + [1.0 if features["last_tool"] == tool else 0.0 for tool in tools]


class ControlTrigger(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A fitted control: standardized features, weights and a bias; compress
    when the logit reaches ``threshold``."""

    tools: list[str]
    """The one-hot vocabulary of last tools (the training points' own)."""
    mean: list[float]
    """Per feature, subtracted before the weights."""
    scale: list[float]
    """Per feature, divided by before the weights."""
    weights: list[float]
    bias: float
    threshold: float = 0.0
    """The logit at which it says compress (0: the class-weighted fit's own boundary)."""
    n_recent: int = 2
    """R: the newest blocks that do not count as old (as annotated)."""
    trained_on: str = ""
    """Where it was fitted: labels, split, points, command."""

    def __post_init__(self) -> None:
        width = 2 * len(NUMERIC) + len(self.tools)
        if not len(self.mean) == len(self.scale) == len(self.weights) == width:
            raise ValueError(f"a control trigger over {width} features needs {width} means, scales and weights")
        numbers = [*self.mean, *self.weights, self.bias, self.threshold]
        if not all(math.isfinite(v) for v in numbers) or not all(math.isfinite(v) and v > 0 for v in self.scale):
            raise ValueError("a control trigger's numbers must be finite and its scales > 0")

    def logit(self, features: dict[str, float | str]) -> float:
        x = feature_vector(features, self.tools)
        return self.bias + sum(
            w * (v - m) / s for w, v, m, s in zip(self.weights, x, self.mean, self.scale, strict=True)
        )

    def compress(self, prefix: Sequence[Message], blocks: Sequence[Block], history: Sequence[Message]) -> bool:
        """Whether the control says compress for this request."""
        return self.logit(request_features(prefix, blocks, history, self.n_recent)) >= self.threshold


async def control_says(
    control: ControlTrigger, request: PolicyRequest, store: MemoryStore, notes: list[str]
) -> bool | None:
    """What ``control`` says of the whole request as the client sent it. A
    control that fails decides nothing (an event says why), so the band's top
    and the window still compact."""
    conversation = request.conversation
    try:
        return control.compress(conversation.prefix, conversation.blocks, request.messages)
    except Exception as exc:
        notes.append(f"control trigger failed: {exc}")
        await store.log_event(request.session_id, "control_failed", {"error": repr(exc)})
        return None


def load_control_trigger(path: str | Path | None = None) -> ControlTrigger:
    """The control of ``path`` (default: the shipped one)."""
    return msgspec.json.decode(Path(path or SHIPPED_CONTROL).read_bytes(), type=ControlTrigger)
