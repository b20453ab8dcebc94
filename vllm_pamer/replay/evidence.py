"""Evidence availability: does the rewritten context still hold what the next action needs?

Pure Python (no network, no vLLM). For a decision point of a trajectory
(history ``messages[:i]``, next action ``messages[i]``, an assistant message):

* the values the action **uses** (``used_values``): for tau-bench
  (``kind="tau"``) ``salient.action_values`` of the recorded action (salient
  values of its text and tool-call arguments); for mini-swe (``kind="swe"``)
  the identifier-like tokens of its command (``command_identifiers``: paths,
  and names of 6+ characters);
* **evidence messages** are the observations a value can come from: for swe
  the tool outputs, for tau every message that is not the agent's own (the
  customer, the tools, the policy prompt); in a rewritten context also every
  message the policy inserted (a summary, recalled memory text);
* the **needed values** are the used values that occur (``salient.occurs``)
  in an evidence message of the history;
* ``availability(needed, messages)`` is the share of them that occur in
  ``messages``; called on ``evidence_messages(rewritten, history, kind)`` it
  says how much of that evidence the rewritten context still holds, raw, in a
  summary or in recalled text. The agent's own earlier commands do not count:
  they echo a value, not the observation it came from. (On the whole rewritten
  context instead, it is the share still *readable* anywhere.)
* ``chars_share(rewritten, original)``: characters of the rewritten context
  over those of the original (``context_chars``).

**One rule for every side** (``needs``, ``readings``; issue 31). The rule
above is one-sided: what a policy inserts counts, the record's copies of the
agent's own calls included, while the same calls in raw assistant messages
never do. The fair readings apply one rule to every policy and to recency:

* the **needs** of a request are the values its recorded action uses that an
  observation after the prefix holds (a tool result or a user turn,
  ``OBSERVATION_ROLES``) and the prefix does not (every policy sends the
  prefix, so none can lose those);
* **readable**: a need counts when it occurs in any message sent after the
  prefix, the agent's own messages, raw observations and inserted text alike;
* **observed**: a need counts only in text that carries an observation: raw
  tool and user messages, and inserted text (not the agent's own role) with
  the record's copies of the agent's calls and words dropped
  (``record.without_echoes``).

``recency_frontier`` computes these for ``recent_k`` (prefix + last k blocks,
as the server's policy sends) directly on trajectories, pooled over every
decision point (``vllm-pamer replay --frontier`` prints it). ``recency_at``
reads that frontier at a policy's character share: the evidence plain
recency keeps for the same characters, the bar a memory policy must clear.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import msgspec

from vllm_pamer.core.blocks import Message, split_conversation
from vllm_pamer.core.policies.pamer.record import without_echoes
from vllm_pamer.salient import (
    PYTHON_BUILTINS,
    STOPLIST,
    action_values,
    argument_leaves,
    message_text,
    occurs,
)
from vllm_pamer.trajectories import agent_requests, trajectory_key

Kind = Literal["tau", "swe"]

EVIDENCE_ROLES: dict[str, frozenset[str]] = {
    "tau": frozenset({"system", "user", "tool"}),
    "swe": frozenset({"tool"}),  # the task is not evidence the agent went and read
}

# Runs of path/identifier characters, split further below; ``~`` and ``.``
# keep ``~/x``, ``./x`` and dotted names in one piece.
_RUN_RE = re.compile(r"[\w.~/-]+")
_NAME_RE = re.compile(r"[A-Za-z_][\w.]*")
_LETTER_RE = re.compile(r"[A-Za-z]")
_ESCAPE_RE = re.compile(r"\\[nrt]")  # a literal backslash-n inside a quoted command separates words
MIN_NAME_CHARS = 6


def trajectory_kind(trajectory: Mapping[str, Any]) -> Kind:
    """``swe`` for coding-agent trajectories (mini-swe-agent), else ``tau``."""
    return "swe" if "swe" in str(trajectory.get("source", "")).lower() else "tau"


def context_text(messages: Iterable[Message]) -> str:
    """Everything a value may be read from: each message's ``message_text``."""
    return "\n".join(message_text(m) for m in messages)


def context_chars(messages: Iterable[Message]) -> int:
    return sum(len(message_text(m)) for m in messages)


def command_identifiers(action: Mapping[str, Any]) -> set[str]:
    """Identifier-like tokens of an action's commands (its tool-call argument
    values): paths (a token with ``/`` and a letter) and names (letters, digits,
    ``_`` and ``.``, starting with a letter or ``_``), of 6+ characters, minus
    the annotator's stoplists. Plain words count too (``Select``, ``django``):
    in a shell command they name files, functions and options."""
    found: set[str] = set()
    leaves = [leaf for call in action.get("tool_calls") or [] for leaf in argument_leaves(call)]
    for leaf in leaves:
        if not isinstance(leaf, str):
            continue
        for run in _RUN_RE.findall(_ESCAPE_RE.sub(" ", leaf)):
            if "/" in run:
                path = run.lstrip("-").rstrip(".-/").removeprefix("./")
                candidates = [path] if _LETTER_RE.search(path) else []
            else:
                candidates = _NAME_RE.findall(run)
            found.update(c.rstrip(".") for c in candidates if len(c.rstrip(".")) >= MIN_NAME_CHARS)
    return found - STOPLIST - PYTHON_BUILTINS


def used_values(action: Mapping[str, Any], kind: Kind) -> set[str]:
    return command_identifiers(action) if kind == "swe" else action_values(action)


def needed_values(history: Sequence[Message], action: Mapping[str, Any], kind: Kind) -> set[str]:
    """The values ``action`` uses that an evidence message of ``history`` holds."""
    roles = EVIDENCE_ROLES[kind]
    texts = [message_text(m) for m in history if m.get("role") in roles]
    return {v for v in used_values(action, kind) if any(occurs(v, t) for t in texts)}


def _key(message: Message) -> str:
    return json.dumps(message, sort_keys=True, default=str)


OBSERVATION_ROLES = frozenset({"user", "tool", "function"})
"""The roles of the messages that carry an observation: what a tool returned,
what the user said (the one rule: the same for every source and every side)."""


def prefix_length(history: Sequence[Message]) -> int:
    """Messages of the prefix P (system messages and the task), which every policy sends first."""
    return len(split_conversation(history).prefix)


def needs(history: Sequence[Message], action: Mapping[str, Any], kind: Kind) -> set[str]:
    """The values ``action`` uses that an observation of ``history`` after the
    prefix holds and the prefix does not: what a policy can lose."""
    p = prefix_length(history)
    prefix = context_text(history[:p])
    texts = [message_text(m) for m in history[p:] if m.get("role") in OBSERVATION_ROLES]
    return {v for v in used_values(action, kind) if not occurs(v, prefix) and any(occurs(v, t) for t in texts)}


class Readings(NamedTuple):
    """How many of a request's needs the context a policy sent holds, by the one rule."""

    readable: int
    """Needs that occur anywhere after the prefix."""
    observed: int
    """Needs that occur in observation text after the prefix (no copy of the agent's own calls and words)."""


def readings(wanted: Iterable[str], sent: Sequence[Message], history: Sequence[Message]) -> Readings:
    """``wanted`` (a request's ``needs``) read in ``sent``, what a policy sent
    for ``history``: the messages after the prefix; a message not in the
    history is the policy's (inserted)."""
    after = list(sent[prefix_length(history) :])
    raw = {_key(m) for m in history}
    observed: list[str] = []
    for message in after:
        role = message.get("role")
        if _key(message) in raw:
            if role in OBSERVATION_ROLES:
                observed.append(message_text(message))
        elif role != "assistant":  # inserted text, the record's echoes of the agent dropped
            observed.append(without_echoes(message_text(message)))
    anywhere, seen = context_text(after), "\n".join(observed)
    values = list(wanted)
    return Readings(sum(occurs(v, anywhere) for v in values), sum(occurs(v, seen) for v in values))


def inserted_messages(sent: Sequence[Message], history: Sequence[Message]) -> list[Message]:
    """The messages of ``sent`` after the prefix that are not in ``history``: what a policy inserted."""
    raw = {_key(m) for m in history}
    return [m for m in sent[prefix_length(history) :] if _key(m) not in raw]


def dropped_observation_chars(sent: Sequence[Message], history: Sequence[Message]) -> int:
    """Characters of the observations after the prefix that ``sent`` does not
    carry as they are (archived, or masked): the text a memory would have to
    keep for them."""
    kept = {_key(m) for m in sent}
    after = history[prefix_length(history) :]
    return sum(len(message_text(m)) for m in after if m.get("role") in OBSERVATION_ROLES and _key(m) not in kept)


def evidence_messages(rewritten: Sequence[Message], original: Sequence[Message], kind: Kind) -> list[Message]:
    """The messages of ``rewritten`` that count as evidence: those with an
    evidence role, and those the policy inserted (not in ``original``)."""
    roles = EVIDENCE_ROLES[kind]
    sent_as_is = {_key(m) for m in original}
    return [m for m in rewritten if m.get("role") in roles or _key(m) not in sent_as_is]


def available_count(needed: Iterable[str], messages: Sequence[Message]) -> int:
    """How many of ``needed`` occur in ``messages``."""
    text = context_text(messages)
    return sum(occurs(v, text) for v in needed)


def availability(needed: Iterable[str], messages: Sequence[Message]) -> float | None:
    """Share of ``needed`` values that occur in ``messages``; None when nothing is needed."""
    values = list(needed)
    return available_count(values, messages) / len(values) if values else None


def chars_share(rewritten: Sequence[Message], original: Sequence[Message]) -> float | None:
    total = context_chars(original)
    return context_chars(rewritten) / total if total else None


def recent_k_context(history: Sequence[Message], k: int) -> list[Message]:
    """What ``recent_k`` sends: the prefix and the last ``k`` blocks."""
    conversation = split_conversation(history)
    _, recent = conversation.old_and_recent(k)
    return list(conversation.prefix) + [m for block in recent for m in block.messages]


Reading = Literal["one_sided", "readable", "observed"]
"""Which evidence figure: the one-sided rule's (``availability``), or one of the one rule's readings."""


class FrontierPoint(msgspec.Struct, frozen=True):
    """recent_k over a set of trajectories, pooled over their decision points:
    ``availability`` = needed values still in an evidence message / needed
    values (the one-sided rule); ``readable`` = the same counted anywhere in
    the context (the agent's own messages too); ``chars_share`` = characters
    sent / characters of the full histories. By the one rule (``needs``):
    ``needs`` in all, the share of them readable (``needs_readable``) and
    observed (``needs_observed``) after the prefix."""

    k: int
    points: int
    points_with_needs: int
    needed: int
    availability: float
    readable: float
    chars_share: float
    needs: int = 0
    needs_readable: float = float("nan")
    needs_observed: float = float("nan")

    def share(self, reading: Reading) -> float:
        """The evidence share of ``reading``."""
        return {"one_sided": self.availability, "readable": self.needs_readable, "observed": self.needs_observed}[
            reading
        ]


def recency_frontier(
    trajectories: Iterable[Mapping[str, Any]],
    ks: Sequence[int] = (2, 10, 20),
    max_steps: int | Mapping[str, int] | None = None,
) -> list[FrontierPoint]:
    """``recent_k``'s evidence availability and character share for each k, on
    the first ``max_steps`` requests of each trajectory (all by default: the
    same requests ``replay --max-steps`` sends). A mapping gives each
    trajectory its own count, by ``trajectories.trajectory_key``; trajectories
    it does not name are skipped.

    Same definitions as ``needed_values`` / ``evidence_messages`` /
    ``availability`` on ``recent_k_context``, computed with one occurrence
    index per trajectory instead of re-reading every history at every step
    (the tests check both agree)."""
    kept = dict.fromkeys(ks, 0)
    readable = dict.fromkeys(ks, 0)
    fair_readable = dict.fromkeys(ks, 0)
    fair_observed = dict.fromkeys(ks, 0)
    sent_chars = dict.fromkeys(ks, 0)
    points = with_needs = needed_total = all_chars = needs_total = 0
    for trajectory in trajectories:
        limit: int | None = max_steps if not isinstance(max_steps, Mapping) else None
        if isinstance(max_steps, Mapping):  # by trajectories.trajectory_key (or, in old records, by id)
            limit = max_steps.get(trajectory_key(trajectory), max_steps.get(str(trajectory.get("id")), 0))
        if limit == 0:
            continue
        kind = trajectory_kind(trajectory)
        roles = EVIDENCE_ROLES[kind]
        messages = trajectory["messages"]
        texts = [message_text(m) for m in messages]
        is_evidence = [m.get("role") in roles for m in messages]
        is_observation = [m.get("role") in OBSERVATION_ROLES for m in messages]
        chars_before = [0]
        for text in texts:
            chars_before.append(chars_before[-1] + len(text))
        conversation = split_conversation(messages)
        prefix_end = len(conversation.prefix)
        starts: list[int] = []  # message index where each block starts
        position = prefix_end
        for block in conversation.blocks:
            starts.append(position)
            position += len(block.messages)
        where: dict[str, list[int]] = {}  # value -> indices of the messages it occurs in

        def occurrences(value: str) -> list[int]:
            if value not in where:
                where[value] = [k for k, text in enumerate(texts) if occurs(value, text)]
            return where[value]

        for step, (i, _) in enumerate(agent_requests(messages)):
            if limit is not None and step >= limit:
                break
            points += 1
            all_chars += chars_before[i]
            used = [occurrences(v) for v in used_values(messages[i], kind)]
            needed = [w for w in used if any(k < i and is_evidence[k] for k in w)]
            needed_total += len(needed)
            with_needs += bool(needed)
            n_blocks = bisect_left(starts, i)  # blocks of the history messages[:i]
            prefix = min(prefix_end, i)
            # the one rule: observed after the prefix, absent from it
            fair = [
                w
                for w in used
                if not any(j < prefix for j in w) and any(prefix <= j < i and is_observation[j] for j in w)
            ]
            needs_total += len(fair)
            for k in ks:
                cut = starts[n_blocks - k] if n_blocks > k else prefix  # first kept block
                sent_chars[k] += chars_before[prefix] + chars_before[i] - chars_before[cut]
                for w in needed:
                    in_context = [j for j in w if j < prefix or cut <= j < i]
                    readable[k] += bool(in_context)
                    kept[k] += any(is_evidence[j] for j in in_context)
                for w in fair:
                    after = [j for j in w if cut <= j < i]
                    fair_readable[k] += bool(after)
                    fair_observed[k] += any(is_observation[j] for j in after)
    nan = float("nan")
    return [
        FrontierPoint(
            k=k,
            points=points,
            points_with_needs=with_needs,
            needed=needed_total,
            availability=kept[k] / needed_total if needed_total else nan,
            readable=readable[k] / needed_total if needed_total else nan,
            chars_share=sent_chars[k] / all_chars if all_chars else nan,
            needs=needs_total,
            needs_readable=fair_readable[k] / needs_total if needs_total else nan,
            needs_observed=fair_observed[k] / needs_total if needs_total else nan,
        )
        for k in ks
    ]


def recency_curve(points: Sequence[FrontierPoint], reading: Reading = "one_sided") -> list[tuple[float, float]]:
    """The frontier as (chars share, evidence share of ``reading``) pairs, by
    chars share, without points that measured nothing."""
    pairs = {(p.chars_share, p.share(reading)) for p in points}
    return sorted((x, y) for x, y in pairs if not math.isnan(x) and not math.isnan(y))


def recency_at(points: Sequence[FrontierPoint], chars_share: float, reading: Reading = "one_sided") -> float | None:
    """The evidence share (of ``reading``) ``recent_k`` keeps at this character
    share, linear between the neighbouring k of ``points`` (which grow with k).
    None below the smallest k's share, where recency has no point to compare."""
    curve = recency_curve(points, reading)
    if not curve or chars_share < curve[0][0]:
        return None
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        if chars_share <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (chars_share - x0) / (x1 - x0)
    return curve[-1][1]


def format_frontier(points: Sequence[FrontierPoint]) -> str:
    lines = [
        "| policy | decision points | with needs | needed values (one-sided) | evidence availability (one-sided) "
        "| readable anywhere (one-sided) | needs (one rule) | readable | observed | chars share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        lines.append(
            f"| recent_{p.k} | {p.points} | {p.points_with_needs} | {p.needed} | {p.availability:.1%} | "
            f"{p.readable:.1%} | {p.needs} | {p.needs_readable:.1%} | {p.needs_observed:.1%} | {p.chars_share:.1%} |"
        )
    return "\n".join(lines)
