"""Decision-point labels for the memory heads: a reproducible, reference-based annotator.

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

A *salient value* is defined by ``salient_values`` (identifiers, ids, paths,
dotted names, dates, long numbers, e-mails) plus, for tool-call arguments, whole
argument strings with a capital letter (names, codes); "uses" means the action's
text or argument values contain it, "occurs" means the exact value appears,
delimited, in a message text. The rule, its examples, its measured counts and
its biases are in docs/annotation.md.

Annotation is a pure function of the trajectory and a token counter: no vLLM,
no engine, no randomness. Other annotators (an LLM annotator through a served
engine) plug in through ``register_annotator``; see ``Annotator``.

CLI: ``python -m vllm_pamer.training.annotate --out labels.jsonl`` (the hook
``vllm_pamer.training.annotate:main(argv)`` serves ``vllm-pamer annotate``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from bisect import bisect_left
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import msgspec

from vllm_pamer.core.blocks import Message, block_id, split_conversation
from vllm_pamer.core.text import serialize_messages

TokenCounter = Callable[[Sequence[Message]], int]
"""Tokens of a list of messages (the annotator calls it once per distinct block)."""

# --------------------------------------------------------------------------------------
# Salient values
# --------------------------------------------------------------------------------------

STOPLIST: frozenset[str] = frozenset(
    {
        # shell plumbing present in almost every command of a coding agent
        "/dev/null",
        "/bin/bash",
        "/bin/sh",
        "/usr/bin/env",
        "/testbed",
        "__init__.py",
        # tau-bench API enumerations: vocabulary of the tool schema (which the
        # recorded trajectories do not keep), not evidence from the history
        "one_way",
        "round_trip",
        "basic_economy",
        "credit_card",
        "gift_card",
    }
)
"""Values that are never salient (ubiquitous plumbing and API vocabulary)."""

PYTHON_BUILTINS: frozenset[str] = frozenset(
    """
    ArithmeticError AssertionError AttributeError BaseException BaseExceptionGroup
    BlockingIOError BrokenPipeError BufferError BytesWarning ChildProcessError
    ConnectionAbortedError ConnectionError ConnectionRefusedError ConnectionResetError
    DeprecationWarning EOFError Ellipsis EncodingWarning EnvironmentError Exception
    ExceptionGroup False FileExistsError FileNotFoundError FloatingPointError FutureWarning
    GeneratorExit IOError ImportError ImportWarning IndentationError IndexError InterruptedError
    IsADirectoryError KeyError KeyboardInterrupt LookupError MemoryError ModuleNotFoundError
    NameError None NotADirectoryError NotImplemented NotImplementedError OSError OverflowError
    PendingDeprecationWarning PermissionError ProcessLookupError RecursionError ReferenceError
    ResourceWarning RuntimeError RuntimeWarning StopAsyncIteration StopIteration SyntaxError
    SyntaxWarning SystemError SystemExit TabError TimeoutError True TypeError UnboundLocalError
    UnicodeDecodeError UnicodeEncodeError UnicodeError UnicodeTranslateError UnicodeWarning
    UserWarning ValueError Warning ZeroDivisionError
    """.split()
)
"""Python's capitalised built-in names (``ValueError``, ``NotImplemented``; the
builtins module of Python 3.11, frozen here so labels do not depend on the
interpreter): language vocabulary, never evidence. Dropped like ``STOPLIST``."""

_TOKEN_RE = re.compile(
    r"""
      (?P<email>[A-Za-z0-9._%+-]+@[A-Za-z0-9-]+(?:\.[A-Za-z0-9-]+)+)
    | (?P<date>\d{4}-\d{2}-\d{2}(?!\d))
    | (?P<path>(?:~|\.{1,2})?/?[\w.-]+(?:/[\w.-]+)+/?|/[A-Za-z_][\w.-]*)
    | (?P<dotted>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)
    | (?P<number>\d+(?:\.\d+)*(?!\w))
    | (?P<word>\w+)
    """,
    re.VERBOSE,
)
_EXTENSION_RE = re.compile(r"\.[A-Za-z][A-Za-z0-9]{0,7}$")
_CAMEL_RE = re.compile(r"[a-z][A-Z]")
_ESCAPE_RE = re.compile(r"\\[nrt]")  # a literal backslash-n in a command separates words


def _is_salient_word(word: str) -> bool:
    """A plain token (letters, digits, underscores) that looks like an identifier."""
    core = word.strip("_")
    has_letter = any(c.isalpha() for c in core)
    has_digit = any(c.isdigit() for c in core)
    if has_letter and has_digit:
        return len(core) >= 4  # HAT136, YAX4DR, mia_li_3668, credit_card_4421486
    if not has_letter:
        return False
    if "_" in core:
        return len(core) >= 6  # snake_case / UPPER_SNAKE identifiers
    return len(core) >= 6 and _CAMEL_RE.search(core) is not None  # camelCase / PascalCase


def _is_salient_number(number: str) -> bool:
    return "." in number or len(number) >= 3


def _is_salient_dotted(name: str) -> bool:
    parts = name.split(".")
    return len(name) >= 4 and max(len(p) for p in parts) >= 2


def _is_salient_path(path: str) -> bool:
    if len(path) < 4 or not any(c.isalpha() for c in path):
        return False
    if path.startswith(("/", "~/", "../")):
        return True
    return _EXTENSION_RE.search(path) is not None or path.count("/") >= 2


def _extract(text: str) -> set[str]:
    found: set[str] = set()
    for match in _TOKEN_RE.finditer(text):
        kind = match.lastgroup
        token = match.group()
        if kind == "email":
            found.add(token.rstrip(".-"))
        elif kind == "date":
            found.add(token)
        elif kind == "path":
            path = token.rstrip(".-/") or token
            if path.startswith("./"):
                path = path[2:]
            if _is_salient_path(path):
                found.add(path)
                parts = [p for p in path.split("/") if p]
                if len(parts) >= 3 and _EXTENSION_RE.search(parts[-1]):
                    found.add("/".join(parts[-2:]))  # dir/file.ext: matches other spellings of the path
        elif kind == "dotted":
            if _is_salient_dotted(token):
                found.add(token)
            found.update(p for p in token.split(".") if _is_salient_word(p))
        elif kind == "number":
            if _is_salient_number(token):
                found.add(token)
        elif _is_salient_word(token):
            found.add(token)
    return found


def salient_values(text: str) -> set[str]:
    """The salient values of a text: exact, case-sensitive strings.

    Scanning left to right, the first rule that matches at a position takes the
    span (so ``2024-05-20`` is one date, not the number ``2024``):

    1. e-mail addresses (``mia.li@example.com``);
    2. ISO dates ``YYYY-MM-DD``;
    3. file paths: a token with ``/`` that is absolute (``/a``, ``~/a``,
       ``../a``), or whose last component has an extension (``a/b.py``), or
       that has 3+ components (``a/b/c``); a leading ``./`` is dropped; a path
       of 3+ components ending in a file also gives its last two components
       (``/testbed/a/b/c.py`` -> ``b/c.py``, which other spellings of the same
       path contain); ``and/or`` is not a path;
    4. dotted names (``module.func``, ``self.serialize_result``, ``b.py``) of
       4+ characters with a component of 2+; each component that is itself an
       identifier (rule 6) is a value too;
    5. numbers with 3+ digits or a decimal point (``122``, ``4421486``,
       ``3.5``); ``19:00`` and ``5`` are not;
    6. identifiers: words mixing letters and digits of 4+ characters
       (``HAT136``, ``YAX4DR``, ``mia_li_3668``, ``Http404``), snake_case
       words of 6+ characters (``serialize_result``, ``INSTALLED_APPS``), and
       camelCase/PascalCase words of 6+ characters (``AutocompleteJsonView``).
       Leading/trailing underscores do not count towards the length
       (``__init__`` is not salient). Plain words (``economy``, ``django``)
       never are.

    Trailing ``.``/``-``/``/`` of paths and e-mails are stripped; a literal
    ``\\n``/``\\t``/``\\r`` (inside a quoted command) separates words; values in
    ``STOPLIST`` and ``PYTHON_BUILTINS`` are dropped.
    """
    return _extract(_ESCAPE_RE.sub(" ", text)) - STOPLIST - PYTHON_BUILTINS


def _content_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _leaves(value: Any) -> Iterable[Any]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    elif value is not None:
        yield value


def argument_leaves(call: Mapping[str, Any]) -> list[Any]:
    """The scalar values of a tool call's arguments (JSON decoded; keys dropped).
    Arguments that are not JSON count as one string."""
    arguments = (call.get("function") or {}).get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return [arguments]
    return list(_leaves(arguments))


def _is_literal(leaf: Any) -> bool:
    """A whole argument string that names something: one token with a capital
    letter (``Noah``, ``Hernandez``, ``BOS``)."""
    return (
        isinstance(leaf, str)
        and 2 <= len(leaf) <= 64
        and not any(c.isspace() for c in leaf)
        and any(c.isupper() for c in leaf)
    )


def action_values(message: Mapping[str, Any]) -> set[str]:
    """V(a): the salient values an assistant action uses - those of its text and
    of its tool-call argument values (not the argument names, not the tool
    name), plus argument strings that are literals (``_is_literal``)."""
    values = salient_values(_content_text(message))
    for call in message.get("tool_calls") or []:
        for leaf in argument_leaves(call):
            if isinstance(leaf, bool):
                continue
            values |= salient_values(str(leaf))
            if _is_literal(leaf) and leaf not in STOPLIST and leaf not in PYTHON_BUILTINS:
                values.add(leaf)
    return values


def message_text(message: Mapping[str, Any]) -> str:
    """The text a value may occur in: the content and the tool-call argument
    values (decoded, so ``\\n`` in a command is a newline). Tool names and call
    ids are not part of it."""
    parts = [_content_text(message)]
    for call in message.get("tool_calls") or []:
        parts.extend(json.dumps(leaf) if isinstance(leaf, bool) else str(leaf) for leaf in argument_leaves(call))
    return "\n".join(p for p in parts if p)


@lru_cache(maxsize=65536)
def _occurrence_re(value: str) -> re.Pattern[str]:
    left = r"(?<!\w)" + (r"(?<!\d[.-])" if value[0].isdigit() else "")
    right = r"(?!\w)" + (r"(?![.-]\d)" if value[-1].isdigit() else "")
    return re.compile(left + re.escape(value) + right)


def occurs(value: str, text: str) -> bool:
    """``value`` appears in ``text`` as a whole: no letter, digit or underscore
    right before or after it, and a number is not part of a longer number or
    date (``122`` does not occur in ``HAT122``, ``122.50`` or ``2024-122``; a
    path occurs inside a longer path that ends with it: ``b/c.py`` in ``/a/b/c.py``)."""
    return value in text and _occurrence_re(value).search(text) is not None


# --------------------------------------------------------------------------------------
# Token counters
# --------------------------------------------------------------------------------------


def char_counter(messages: Sequence[Message]) -> int:
    """Cheap approximation: characters of the plain-text view // 4 (tests)."""
    return len(serialize_messages(messages)) // 4


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


def tokenizer_counter(model: str | Path | None = None) -> TokenCounter:
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


def _block_tokens(block_messages: Sequence[Message], count_tokens: TokenCounter, cache: dict[str, int]) -> int:
    key = block_id(block_messages)
    if key not in cache:
        cache[key] = int(count_tokens(block_messages))
    return cache[key]


def decision_contexts(
    trajectory: Mapping[str, Any],
    count_tokens: TokenCounter,
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
    prefix_end = len(conversation.prefix)
    starts: list[int] = []
    cumulative = [0]  # cumulative[k] = tokens of blocks[:k]
    position = prefix_end
    for block in conversation.blocks:
        starts.append(position)
        position += len(block.messages)
        cumulative.append(cumulative[-1] + _block_tokens(block.messages, count_tokens, cache))

    contexts: list[DecisionContext] = []
    users = 0
    last_tool: str | None = None
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
                    last_tool=last_tool,
                )
            )
        if role == "user":
            users += 1
        for call in message.get("tool_calls") or []:
            last_tool = (call.get("function") or {}).get("name") or last_tool
    return contexts


class _Occurrences:
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


def _old_only(where: list[int], ctx: DecisionContext, until: int, observed: Sequence[bool]) -> bool:
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


def annotate_trajectory(
    trajectory: Mapping[str, Any],
    count_tokens: TokenCounter,
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
    messages = list(trajectory["messages"])
    contexts = decision_contexts(trajectory, count_tokens, settings, token_cache)
    where = _Occurrences([message_text(m) for m in messages])
    observed = [m.get("role") != "assistant" for m in messages]
    values = {ctx.message_index: sorted(action_values(messages[ctx.message_index])) for ctx in contexts}
    trajectory_id = str(trajectory.get("id", ""))
    source = str(trajectory.get("source", ""))

    points: list[DecisionPoint] = []
    for j, ctx in enumerate(contexts):
        i = ctx.message_index
        recall: int | None = None
        recall_values: list[str] = []
        if ctx.n_old_blocks > 0:
            recall_values = [v for v in values[i] if _old_only(where(v), ctx, i, observed)]
            recall = int(bool(recall_values))
        compression: int | None = None
        compression_values: list[str] = []
        if ctx.n_old_blocks > 0 and ctx.old_tokens >= min_old_tokens:
            used: set[str] = set()
            for later in contexts[j : j + max(1, horizon)]:
                a = later.message_index
                used.update(v for v in values[a] if _old_only(where(v), ctx, a, observed))
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


def available_annotators() -> list[str]:
    return sorted(_REGISTRY)


def create_annotator(
    name: str,
    settings: AnnotatorSettings | None = None,
    count_tokens: TokenCounter | None = None,
    **options: Any,
) -> Annotator:
    """Build the annotator registered as ``name`` (default counter: the default
    model's tokenizer)."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise UnknownAnnotator(
            f"unknown annotator {name!r}; available: {', '.join(available_annotators())}"
        ) from None
    return factory(settings or AnnotatorSettings(), count_tokens or tokenizer_counter(), **options)


@register_annotator("reference")
class ReferenceAnnotator:
    """The default: ``annotate_trajectory``'s reference rule. Block token counts
    are cached across trajectories."""

    name = "reference"

    def __init__(self, settings: AnnotatorSettings, count_tokens: TokenCounter) -> None:
        self.settings = settings
        self.count_tokens = count_tokens
        self.token_cache: dict[str, int] = {}

    def annotate(self, trajectory: Mapping[str, Any]) -> list[DecisionPoint]:
        s = self.settings
        return annotate_trajectory(
            trajectory, self.count_tokens, s.n_recent, s.horizon, s.min_old_tokens, token_cache=self.token_cache
        )


# --------------------------------------------------------------------------------------
# Summary and CLI
# --------------------------------------------------------------------------------------


def summarize(points: Iterable[DecisionPoint]) -> dict[str, dict[str, int]]:
    """Counts per source (and ``all``): decision points, gate holds,
    compression 1/0, recall evaluated/1, trajectories."""
    table: dict[str, dict[str, int]] = {}
    seen: dict[str, set[str]] = {}
    for p in points:
        for key in (p.source, "all"):
            row = table.setdefault(
                key,
                dict.fromkeys(
                    ("trajectories", "decisions", "gate", "compress_1", "compress_0", "recall_eval", "recall_1"), 0
                ),
            )
            ids = seen.setdefault(key, set())
            if p.trajectory_id not in ids:
                ids.add(p.trajectory_id)
                row["trajectories"] += 1
            row["decisions"] += 1
            if p.compression is not None:
                row["gate"] += 1
                row["compress_1" if p.compression else "compress_0"] += 1
            if p.recall is not None:
                row["recall_eval"] += 1
                row["recall_1"] += p.recall
    if "all" in table:  # keep "all" last
        table["all"] = table.pop("all")
    return table


def format_summary(table: Mapping[str, Mapping[str, int]]) -> str:
    columns = ("trajectories", "decisions", "gate", "compress_1", "compress_0", "recall_eval", "recall_1")
    width = max([len("source")] + [len(k) for k in table])
    lines = [f"{'source':<{width}}  " + "  ".join(f"{c:>12}" for c in columns)]
    for key, row in table.items():
        lines.append(f"{key:<{width}}  " + "  ".join(f"{row[c]:>12}" for c in columns))
    return "\n".join(lines)


def _load(paths: Sequence[str] | None, limit: int | None) -> list[dict[str, Any]]:
    from vllm_pamer.trajectories import load_trajectories

    sets = [load_trajectories(p) for p in paths] if paths else [
        load_trajectories(None, "tau"),
        load_trajectories(None, "swe"),
    ]
    out: list[dict[str, Any]] = []
    for trajectories in sets:
        out.extend(trajectories[:limit] if limit is not None else trajectories)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    """``vllm-pamer annotate``: label trajectories, write JSON lines, print counts."""
    parser = argparse.ArgumentParser(
        prog="vllm-pamer annotate",
        description="Label the decision points of agent trajectories (recall / compression) as JSON lines.",
    )
    parser.add_argument(
        "--data", action="append", default=None, metavar="PATH",
        help="trajectories (.jsonl or .jsonl.gz); repeatable (default: both shipped samples)",
    )
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="first N trajectories of each file")
    parser.add_argument("--out", required=True, metavar="PATH", help="output JSON lines, one decision point each")
    parser.add_argument("--annotator", default="reference", help="registered annotator (default: reference)")
    parser.add_argument(
        "--tokens", choices=("model", "chars"), default="model",
        help="token counter: the model's tokenizer (default) or characters // 4",
    )
    parser.add_argument("--tokenizer", default=None, metavar="PATH", help="tokenizer directory (default: the embedded model)")
    defaults = AnnotatorSettings()
    parser.add_argument("--n-recent", type=int, default=defaults.n_recent, help="recent blocks R_t (default 2)")
    parser.add_argument("--horizon", type=int, default=defaults.horizon, help="actions compression looks at (default 3)")
    parser.add_argument(
        "--min-old-tokens", type=int, default=defaults.min_old_tokens, help="compression gate on tokens(O_t) (default 1024)"
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    settings = AnnotatorSettings(n_recent=args.n_recent, horizon=args.horizon, min_old_tokens=args.min_old_tokens)
    counter = char_counter if args.tokens == "chars" else tokenizer_counter(args.tokenizer)
    try:
        annotator = create_annotator(args.annotator, settings, counter)
    except UnknownAnnotator as exc:
        parser.error(str(exc))
    trajectories = _load(args.data, args.limit)

    from tqdm import tqdm

    started = time.monotonic()
    points: list[DecisionPoint] = []
    encoder = msgspec.json.Encoder()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as handle:
        for trajectory in tqdm(trajectories, desc="annotating", unit="traj", disable=args.no_progress):
            for point in annotator.annotate(trajectory):
                handle.write(encoder.encode(point) + b"\n")
                points.append(point)
    elapsed = time.monotonic() - started
    print(f"wrote {len(points)} decision points of {len(trajectories)} trajectories to {out} in {elapsed:.1f} s")
    print(
        f"annotator={annotator.name} tokens={args.tokens} n_recent={settings.n_recent} "
        f"horizon={settings.horizon} min_old_tokens={settings.min_old_tokens}"
    )
    print(format_summary(summarize(points)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
