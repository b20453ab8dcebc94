"""Decision-point labels for the memory heads: a reproducible, reference-based annotator.
(Slightly longer than 400 lines: the reference rule and its registry read as one piece.)

The paper (section 3.1, Appendix A.1) labels each decision point of a trajectory
with an LLM annotator. Offline we have none, so the default annotator here
(``reference``) derives *silver* labels from what the agent actually did next:

* a **decision point** is each request of a trajectory before an assistant
  action (``vllm_pamer.trajectories.agent_requests``): request ``messages[:i]``,
  next action ``a_t = messages[i]``; the request splits into the prefix P_t,
  the old blocks O_t and the ``n_recent`` (2) most recent blocks R_t
  (``vllm_pamer.core.blocks``);
* **recall** = 1 when ``a_t`` uses a salient value that occurs in O_t but not
  in P_t nor in R_t (and that first entered the trajectory through an
  observation, not the agent's own words); 0 when it uses none; None when O_t
  is empty;
* **compression** (only where tokens(O_t) >= 1024, else None) = 1 when none of
  the next ``horizon`` (3) actions uses a value that only O_t holds (stale old
  history), 0 otherwise.

What a salient value is, what "uses" and "occurs" mean: ``vllm_pamer.salient``
(shared with the replay). The rule, its examples, its measured counts and its
biases are in docs/annotation.md.

Annotation is a pure function of the trajectory and a token counter: no vLLM,
no engine, no randomness. Other annotators (an LLM annotator through a served
engine) plug in through ``register_annotator``; see ``Annotator``. The command
``vllm-pamer annotate`` is ``vllm_pamer.training.cli.annotate_main``.
"""

from __future__ import annotations

import importlib
import itertools
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import msgspec

from vllm_pamer.core.blocks import Conversation, Message, block_id, last_tool, split_conversation
from vllm_pamer.core.text import char_tokens, serialize_messages
from vllm_pamer.salient import action_values, message_text, occurs

CountTokens = Callable[[Sequence[Message]], int]
"""A function: tokens of a list of messages (the annotator calls it once per distinct block)."""

# --------------------------------------------------------------------------------------
# Token counts
# --------------------------------------------------------------------------------------
# Not core/tokens.py's TokenCounter, which counts through the served chat template:
# the reference rule is defined on each block's plain-text view (docs/annotation.md),
# so its labels depend on no template and its documented counts stay as measured.


char_counter: CountTokens = char_tokens
"""Characters of the plain-text view // 4 (``core/text.py``): no tokenizer at
all (tests, ``--tokens chars``, the metadata control's own count), close
enough for the rule's 1024-token threshold."""


def _text_encoder(path: str | Path) -> Callable[[str], int]:
    """Token count of a text, without special tokens. A ``tokenizer.json`` is
    read with ``tokenizers`` directly (the same ids as the transformers fast
    tokenizer, without importing transformers); otherwise AutoTokenizer."""
    tokenizer_json = Path(path) / "tokenizer.json"
    if tokenizer_json.exists():
        from tokenizers import Tokenizer

        fast = Tokenizer.from_file(str(tokenizer_json))
        return lambda text: len(fast.encode(text, add_special_tokens=False).ids)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path))
    tokenizer.model_max_length = 1 << 40  # we count, we do not run the model
    return lambda text: len(tokenizer.encode(text, add_special_tokens=False))


def tokenizer_counter(model: str | Path | None = None) -> CountTokens:
    """Tokens of the plain-text view (``serialize_messages``: roles, contents,
    tool calls with their arguments), no special tokens, with the tokenizer of
    ``model`` (a directory; default: the embedded default model). Loaded on
    first use."""
    state: dict[str, Callable[[str], int]] = {}

    def count(messages: Sequence[Message]) -> int:
        text = serialize_messages(messages)
        if not text:
            return 0
        encode = state.get("encode")
        if encode is None:
            path = model
            if path is None:
                from vllm_pamer.default_model import ensure_default_model

                path = ensure_default_model(quiet=True)
            encode = state["encode"] = _text_encoder(path)
        return encode(text)

    return count


# --------------------------------------------------------------------------------------
# Decision points
# --------------------------------------------------------------------------------------


class AnnotatorSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What defines a decision point's context; shared by every annotator."""

    n_recent: int = 2
    """R_t: the most recent complete blocks (the paper's Recent2)."""
    horizon: int = 3
    """Compression looks at this many actions, starting with the next one."""
    min_old_tokens: int = 1024
    """Compression gate: tokens(O_t) must reach this (PaMER's candidate size)."""


class DecisionContext(msgspec.Struct, frozen=True):
    """Where a decision point's P / O / R lie in the trajectory's messages:
    P = messages[:prefix_end], O = messages[prefix_end:old_end],
    R = messages[old_end:message_index]; the next action is
    messages[message_index]."""

    step: int
    message_index: int
    prefix_end: int
    old_end: int
    n_old_blocks: int
    n_recent_blocks: int
    old_tokens: int
    turn: int
    last_tool: str | None


class DecisionPoint(msgspec.Struct, frozen=True):
    """One labelled decision point (one JSON line of ``vllm-pamer annotate``)."""

    trajectory_id: str
    step: int
    """Index among the trajectory's decision points (0-based)."""
    message_index: int
    """Index of the next action (assistant message) in the trajectory."""
    n_messages: int
    """Messages in the request (= message_index)."""
    n_old_blocks: int
    old_tokens: int
    """tokens(O_t): sum of the per-block counts of the old blocks."""
    turn: int
    """User messages in the request (the dialogue turn; 1 for one-instruction agents)."""
    last_tool: str | None
    """Name of the last tool called before the decision."""
    recall: int | None
    compression: int | None
    recall_values: list[str]
    """Values of a_t found only in O_t (why recall is 1)."""
    source: str
    compression_values: list[str] = []
    """Values of the next ``horizon`` actions found only in O_t (why compression is 0)."""
    annotator: str = "reference"


def block_tokens(block_messages: Sequence[Message], count_tokens: CountTokens, cache: dict[str, int]) -> int:
    key = block_id(block_messages)
    if key not in cache:
        cache[key] = int(count_tokens(block_messages))
    return cache[key]


def block_layout(
    conversation: Conversation, count_tokens: CountTokens, cache: dict[str, int]
) -> tuple[list[int], list[int]]:
    """Each block's first message index in the trajectory and its tokens."""
    starts: list[int] = []
    tokens: list[int] = []
    position = len(conversation.prefix)
    for block in conversation.blocks:
        starts.append(position)
        position += len(block.messages)
        tokens.append(block_tokens(block.messages, count_tokens, cache))
    return starts, tokens


def decision_contexts(
    trajectory: Mapping[str, Any],
    count_tokens: CountTokens,
    settings: AnnotatorSettings | None = None,
    token_cache: dict[str, int] | None = None,
) -> list[DecisionContext]:
    """The decision points of a trajectory (the requests of ``agent_requests``:
    one per assistant message after the first message) with their P / O / R
    split as ``split_conversation(messages[:i]).old_and_recent(n_recent)``
    gives it. The trajectory is split once: because ``messages[i]`` opens a
    block, the blocks of ``messages[:i]`` are the trajectory's blocks that start
    before ``i``. Block tokens are counted once per block (``token_cache``, by
    ``block_id``; share a cache only between calls with the same counter)."""
    settings = settings or AnnotatorSettings()
    cache = {} if token_cache is None else token_cache
    messages = list(trajectory["messages"])
    conversation = split_conversation(messages)
    starts, tokens = block_layout(conversation, count_tokens, cache)
    return _contexts(messages, len(conversation.prefix), starts, tokens, settings)


def _contexts(
    messages: Sequence[Message], prefix_end: int, starts: list[int], tokens: list[int], settings: AnnotatorSettings
) -> list[DecisionContext]:
    """``decision_contexts`` of a trajectory already split and laid out."""
    cumulative = [0, *itertools.accumulate(tokens)]  # cumulative[k] = tokens of blocks[:k]

    contexts: list[DecisionContext] = []
    users = 0
    for i, message in enumerate(messages):
        role = message.get("role")
        if role == "assistant" and i > 0:
            n_blocks = bisect_left(starts, i)
            cut = n_blocks if settings.n_recent <= 0 else max(0, n_blocks - settings.n_recent)
            old_end = starts[cut] if cut < n_blocks else i
            contexts.append(
                DecisionContext(
                    step=len(contexts),
                    message_index=i,
                    prefix_end=min(prefix_end, i),
                    old_end=old_end if cut > 0 else min(prefix_end, i),
                    n_old_blocks=cut,
                    n_recent_blocks=n_blocks - cut,
                    old_tokens=cumulative[cut],
                    turn=users,
                    last_tool=last_tool(messages[:i]),
                )
            )
        if role == "user":
            users += 1
    return contexts


class Occurrences:
    """Where each value occurs in a trajectory: sorted message indices."""

    def __init__(self, texts: Sequence[str]) -> None:
        self.texts = texts
        self._where: dict[str, list[int]] = {}

    def __call__(self, value: str) -> list[int]:
        where = self._where.get(value)
        if where is None:
            where = [k for k, text in enumerate(self.texts) if occurs(value, text)]
            self._where[value] = where
        return where


def _any_in(indices: list[int], start: int, end: int) -> bool:
    k = bisect_left(indices, start)
    return k < len(indices) and indices[k] < end


def old_only(where: list[int], ctx: DecisionContext, until: int, observed: Sequence[bool]) -> bool:
    """The value is evidence only O_t holds: it occurs in O_t, first in an
    observation (``observed``: a tool result or user message, not an agent
    action), and neither in P_t nor in any message after O_t before message
    ``until`` (R_t, and for later actions what came since)."""
    return (
        _any_in(where, ctx.prefix_end, ctx.old_end)
        and not _any_in(where, 0, ctx.prefix_end)
        and not _any_in(where, ctx.old_end, until)
        and observed[where[0]]
    )


class TrajectoryFacts(msgspec.Struct, frozen=True):
    """What every annotator reads of one trajectory, worked out once
    (``read_trajectory``): its decision points, where each value occurs, which
    messages are observations, each action's values, and its split into
    prefix and blocks with each block's start and tokens."""

    messages: list[Message]
    contexts: list[DecisionContext]
    where: Occurrences
    observed: list[bool]
    """Message i is not the agent's (a tool result, a user or system message)."""
    values: dict[int, list[str]]
    """The salient values of the action at each decision point's message index."""
    conversation: Conversation
    """The trajectory's prefix and blocks."""
    block_starts: list[int]
    """Each block's first message index (``block_layout``)."""
    block_tokens: list[int]
    """Each block's tokens (``block_layout``)."""


def read_trajectory(
    trajectory: Mapping[str, Any],
    count_tokens: CountTokens,
    settings: AnnotatorSettings,
    token_cache: dict[str, int] | None = None,
) -> TrajectoryFacts:
    messages = list(trajectory["messages"])
    conversation = split_conversation(messages)
    starts, tokens = block_layout(conversation, count_tokens, {} if token_cache is None else token_cache)
    contexts = _contexts(messages, len(conversation.prefix), starts, tokens, settings)
    return TrajectoryFacts(
        messages=messages,
        contexts=contexts,
        where=Occurrences([message_text(m) for m in messages]),
        observed=[m.get("role") != "assistant" for m in messages],
        values={ctx.message_index: sorted(action_values(messages[ctx.message_index])) for ctx in contexts},
        conversation=conversation,
        block_starts=starts,
        block_tokens=tokens,
    )


def annotate_trajectory(
    trajectory: Mapping[str, Any],
    count_tokens: CountTokens,
    n_recent: int = 2,
    horizon: int = 3,
    min_old_tokens: int = 1024,
    *,
    token_cache: dict[str, int] | None = None,
) -> list[DecisionPoint]:
    """Reference labels for every decision point of ``trajectory`` (pure: the
    same trajectory and counter always give the same list).

    A value v is *old-only evidence* at t for an action a (at message index
    ``a``) when it occurs in O_t, its first occurrence in the trajectory is an
    observation (tool result or user message, not an agent action), and it
    occurs neither in P_t nor in any message from the end of O_t up to a.

    * recall_t = 1 iff some v in V(a_t) is old-only evidence at t for a_t (for
      a_t, "up to a_t" is R_t) - ``recall_values``; 0 otherwise; None when O_t
      is empty.
    * compression_t, where tokens(O_t) >= ``min_old_tokens`` (else None): 0 iff
      some action a among the next ``horizon`` ones (a_t, a_t+1, ...; fewer at
      the end of the trajectory) uses a value v in V(a) that is old-only
      evidence at t for a (``compression_values``); else 1.
    """
    settings = AnnotatorSettings(n_recent=n_recent, horizon=horizon, min_old_tokens=min_old_tokens)
    return reference_points(trajectory, read_trajectory(trajectory, count_tokens, settings, token_cache), settings)


def reference_points(
    trajectory: Mapping[str, Any], facts: TrajectoryFacts, settings: AnnotatorSettings
) -> list[DecisionPoint]:
    """``annotate_trajectory``'s labels from facts already read."""
    contexts, where, observed, values = facts.contexts, facts.where, facts.observed, facts.values
    horizon, min_old_tokens = settings.horizon, settings.min_old_tokens
    trajectory_id = str(trajectory.get("id", ""))
    source = str(trajectory.get("source", ""))

    points: list[DecisionPoint] = []
    for j, ctx in enumerate(contexts):
        i = ctx.message_index
        recall: int | None = None
        recall_values: list[str] = []
        if ctx.n_old_blocks > 0:
            recall_values = [v for v in values[i] if old_only(where(v), ctx, i, observed)]
            recall = int(bool(recall_values))
        compression: int | None = None
        compression_values: list[str] = []
        if ctx.n_old_blocks > 0 and ctx.old_tokens >= min_old_tokens:
            used: set[str] = set()
            for later in contexts[j : j + max(1, horizon)]:
                a = later.message_index
                used.update(v for v in values[a] if old_only(where(v), ctx, a, observed))
            compression_values = sorted(used)
            compression = 0 if used else 1
        points.append(
            DecisionPoint(
                trajectory_id=trajectory_id,
                step=ctx.step,
                message_index=i,
                n_messages=i,
                n_old_blocks=ctx.n_old_blocks,
                old_tokens=ctx.old_tokens,
                turn=ctx.turn,
                last_tool=ctx.last_tool,
                recall=recall,
                compression=compression,
                recall_values=recall_values,
                source=source,
                compression_values=compression_values,
            )
        )
    return points


# --------------------------------------------------------------------------------------
# Pluggable annotators
# --------------------------------------------------------------------------------------


@runtime_checkable
class Annotator(Protocol):
    """Labels every decision point of a trajectory.

    Contract: ``annotate`` returns one ``DecisionPoint`` per entry of
    ``decision_contexts(trajectory, count_tokens, settings)``, in that order,
    with the context fields copied from it, ``annotator`` set to ``name`` and
    the same None rules (recall None where O_t is empty, compression None below
    the gate); only how recall/compression are decided differs. An annotator is
    built by the factory registered under its name, called as
    ``factory(settings, count_tokens, **options)``.
    """

    name: str

    def annotate(self, trajectory: Mapping[str, Any]) -> list[DecisionPoint]: ...


AnnotatorFactory = Callable[..., Annotator]


class UnknownAnnotator(ValueError):
    pass


_REGISTRY: dict[str, AnnotatorFactory] = {}


def register_annotator(name: str) -> Callable[[AnnotatorFactory], AnnotatorFactory]:
    """Decorator: make an annotator factory (or class) selectable by ``name``."""

    def decorate(factory: AnnotatorFactory) -> AnnotatorFactory:
        if name in _REGISTRY and _REGISTRY[name] is not factory:
            raise ValueError(f"annotator name {name!r} is already registered")
        _REGISTRY[name] = factory
        return factory

    return decorate


BUILTIN_MODULES = ("vllm_pamer.training.hindsight",)
"""The modules of the annotators shipped beside this one; they import this
module to register, so the registry imports them when first read."""


def _registry() -> dict[str, AnnotatorFactory]:
    for module in BUILTIN_MODULES:
        importlib.import_module(module)
    return _REGISTRY


def annotator_definition(name: str) -> str:
    """What the labels of the annotator registered as ``name`` mean (empty: unknown)."""
    return str(getattr(_registry().get(name), "definition", ""))


def available_annotators() -> list[str]:
    return sorted(_registry())


def create_annotator(
    name: str,
    settings: AnnotatorSettings | None = None,
    count_tokens: CountTokens | None = None,
    **options: Any,
) -> Annotator:
    """Build the annotator registered as ``name`` (default counter: the default
    model's tokenizer)."""
    try:
        factory = _registry()[name]
    except KeyError:
        raise UnknownAnnotator(f"unknown annotator {name!r}; available: {', '.join(available_annotators())}") from None
    return factory(settings or AnnotatorSettings(), count_tokens or tokenizer_counter(), **options)


@register_annotator("reference")
class ReferenceAnnotator:
    """The default: ``annotate_trajectory``'s reference rule. Block token counts
    are cached across trajectories."""

    name = "reference"
    definition = "the reference rule's silver labels (docs/annotation.md)"

    def __init__(self, settings: AnnotatorSettings, count_tokens: CountTokens) -> None:
        self.settings = settings
        self.count_tokens = count_tokens
        self.token_cache: dict[str, int] = {}

    def annotate(self, trajectory: Mapping[str, Any]) -> list[DecisionPoint]:
        s = self.settings
        return annotate_trajectory(
            trajectory, self.count_tokens, s.n_recent, s.horizon, s.min_old_tokens, token_cache=self.token_cache
        )
