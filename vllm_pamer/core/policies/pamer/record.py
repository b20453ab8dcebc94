"""The verbatim record of archived steps: what a memory keeps besides its
summary, so exact values survive a compaction whatever the summarizer writes.

It is readable text in the steps' order, never a list of extracted values:
per archived step, lines of the agent's own words, its tool calls with their
exact arguments (one over ``CALL_CHARS``, a file written inline, keeps its
beginning and end), what the user said (instructions, corrections: always
kept, verbatim) and lines of the tool results. Which lines, within the
character budget, is ``excerpts.choose``'s: the ones that add the most
words the request would otherwise not hold, per character, favouring recent
steps and those most like the current work (the blocks kept raw). So a name seen once
in an old result outlives the tenth listing of the same directory, and a
call repeated many times is shown once. The PaMER paper found restored raw
steps worth more than summaries; this keeps the raw lines that carry most.
When even the user turns do not fit, the oldest steps are left out, and the
record says so; the newest step's turns then keep their beginning and end.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence

from vllm_pamer.core.blocks import Block, Message
from vllm_pamer.core.policies.baselines import TOOL_ROLES
from vllm_pamer.core.policies.pamer.excerpts import WORD, choose, pieces, units, words
from vllm_pamer.core.text import cap_head_and_tail

RECORD_HEADER = "Record of the archived steps (tool calls exactly, user turns verbatim, result excerpts):"


def _text(content: object) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return ""


def _call_line(call: dict[str, object]) -> str:
    function = call.get("function")
    function = function if isinstance(function, dict) else {}
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return f"called {function.get('name')}({arguments})"


def _held_text(message: Message) -> str:
    """A message's text and its calls, as the model reads them."""
    calls = [_call_line(c) for c in message.get("tool_calls") or [] if isinstance(c, dict)]
    return "\n".join([_text(message.get("content")), *calls])


def _one_line(text: str) -> str:
    return " ".join(text.split())


CALL_CHARS = 300
"""Characters a tool call keeps at most: a long one (a file written inline)
keeps its beginning and end, so it does not crowd out whole earlier steps."""
GAP = " [...] "
"""Where the record left out the middle of a call or user turn."""
LINE_GAP = " [...]"
"""After a line that lines the record left out follow."""
LINE_CHARS_MIN = 80
"""Characters a user turn keeps, at the least, when the newest step alone is too long."""
_SENTENCE = re.compile(r"(?<=[.!?:])\s+")

ECHO_MARKS = ("called ", "agent: ")
"""How the record's items that copy the agent's own calls and words begin
(after a step's two-space indent); an evaluation that credits only what the
agent observed drops them (``without_echoes``)."""
ITEM_MARKS = (*ECHO_MARKS, "user: ", "result: ")
"""Every item of a step; an item runs until the next item or step."""


class _Part:
    """One thing of a step the record may show in part: the agent's words,
    one call, or one result, cut into units (lines, sentences, a whole call)."""

    def __init__(self, kind: str, pieces_: list[str], source: int = -1) -> None:
        self.kind = kind
        self.units = pieces_
        self.kept: set[int] = set()
        self.source = source
        """The index of the message it comes from in its block."""

    def render(self) -> str | None:
        """The units kept, in order, a gap mark where some were left out; None: nothing kept."""
        if not self.kept:
            return None
        order = sorted(self.kept)
        if self.kind == "call":
            return self.units[0]
        gap = [i + 1 < len(self.units) and i + 1 not in self.kept for i in order]  # lines left out after it
        shown = [self.units[i] + (LINE_GAP if g else "") for i, g in zip(order, gap)]
        label, joint = ("agent: ", " ") if self.kind == "agent" else ("result: ", "\n")  # sentences: one line
        return label + ("[...] " if order[0] else "") + joint.join(shown)


class _Step:
    """One archived block: its parts, and the user's turns (always shown)."""

    def __init__(self, number: int, block: Block) -> None:
        self.number = number
        self.parts: list[_Part] = []
        self.user: list[str] = []
        for index, message in enumerate(block.messages):
            role = message.get("role")
            text = _text(message.get("content")).strip()
            if role == "assistant":
                if text:
                    sentences = [p for s in _SENTENCE.split(_one_line(text)) for p in pieces(s)]
                    self.parts.append(_Part("agent", sentences))
                for call in message.get("tool_calls") or []:
                    if isinstance(call, dict):
                        self.parts.append(_Part("call", [cap_head_and_tail(_call_line(call), CALL_CHARS, GAP)]))
            elif role == "user" and text:
                self.user.append(f"user: {text}")
            elif text:  # a tool (or function) result
                self.parts.append(_Part("result", units(text), index))
        self.user_chars = 0
        """Characters of each user turn shown (0: whole), when the newest step alone is too long."""

    def render(self) -> str:
        """``step N:`` and an item a line (continuation lines indented under it); empty: nothing shown."""
        shown = [p.render() for p in self.parts if p.kind != "result"]
        shown += [cap_head_and_tail(u, self.user_chars, GAP) if self.user_chars else u for u in self.user]
        shown += [p.render() for p in self.parts if p.kind == "result"]
        items = ["  " + text.replace("\n", "\n    ") for text in shown if text]
        return "\n".join([f"step {self.number}:", *items]) if items else ""


def _words(messages: Sequence[Message]) -> Counter[str]:
    return Counter(w.lower() for m in messages for w in WORD.findall(_text(m.get("content"))))


def relevance(blocks: Sequence[Block], current: Sequence[Block]) -> list[float]:
    """How alike each block is to the current work (cosine of TF-IDF word
    vectors, IDF over ``blocks``); 0 when either side has no words."""
    docs = [_words(b.messages) for b in blocks]
    now = _words([m for b in current for m in b.messages])
    df: Counter[str] = Counter(w for d in docs for w in d)
    idf = {w: math.log((1 + len(docs)) / (1 + n)) + 1 for w, n in df.items()}

    def vector(counts: Counter[str]) -> dict[str, float]:
        return {w: c * idf.get(w, 1.0) for w, c in counts.items()}

    query = vector(now)
    q_norm = math.sqrt(sum(v * v for v in query.values()))
    scores = []
    for doc in docs:
        vec = vector(doc)
        norm = math.sqrt(sum(v * v for v in vec.values()))
        dot = sum(v * query.get(w, 0.0) for w, v in vec.items())
        scores.append(dot / (norm * q_norm) if norm and q_norm else 0.0)
    return scores


RECENCY_STEPS = 4.0
"""A step this many steps before the newest archived one weighs half what the
newest does: what was read last is read again soonest."""
RELEVANCE = 1.0
"""How much a step's likeness to the current work adds to its weight."""


def _weight(relevance_: float, age: int) -> float:
    """How much a word of a step counts, by its likeness to the current work and its age (1: newest)."""
    return (1.0 + RELEVANCE * relevance_) * RECENCY_STEPS / (RECENCY_STEPS + age - 1)


def step_record(
    blocks: Sequence[Block],
    current: Sequence[Block],
    budget_chars: int,
    first_step: int = 1,
    known: Sequence[Message] = (),
) -> str:
    """The record of ``blocks`` (numbered from ``first_step``) within
    ``budget_chars``; ``current`` (the blocks that stay raw) and ``known``
    (the prefix) are what the request holds besides it: the lines kept are
    those that add most to them (``excerpts.choose``)."""
    steps = [_Step(first_step + i, b) for i, b in enumerate(blocks)]
    scores = relevance(blocks, current)
    omitted = 0
    shown = {id(s): s.render() for s in steps}  # each step's text, made again only when it changes

    def note() -> str:
        return f"(steps {first_step}-{first_step + omitted - 1} omitted for space)" if omitted else ""

    def size() -> int:
        return len(RECORD_HEADER) + len(note()) + 1 + sum(len(shown[id(s)]) + 1 for s in steps if shown[id(s)])

    # 1. the user's turns, always; the oldest steps leave when even they do not fit
    while len(steps) > 1 and size() > budget_chars:
        steps.pop(0)
        omitted += 1
    if steps and size() > budget_chars:  # the newest step alone is too long: shorten its turns
        newest = steps[0]
        newest.user_chars = max(LINE_CHARS_MIN, max(map(len, newest.user), default=0) - (size() - budget_chars))
        shown[id(newest)] = newest.render()
        while newest.user_chars > LINE_CHARS_MIN and size() > budget_chars:
            newest.user_chars = max(LINE_CHARS_MIN, newest.user_chars * 3 // 4)
            shown[id(newest)] = newest.render()
    # 2. the lines that add most to what the request holds, in the room left
    parts = [(step, part) for step in steps for part in step.parts]
    held = [m for b in current for m in b.messages] + list(known)
    turns = "\n".join(u for step in steps for u in step.user)
    picks = choose(
        [part.units for _, part in parts],
        [_weight(scores[step.number - first_step], len(blocks) + first_step - step.number) for step, _ in parts],
        words("\n".join(_held_text(m) for m in held)) | words(turns),
        budget_chars - size(),
    )
    for o, u in picks:
        parts[o][1].kept.add(u)
    shown.update((id(step), step.render()) for step in {id(s): s for s, _ in parts}.values())
    while picks and size() > budget_chars:  # step labels and gap marks the choice did not count
        o, u = picks.pop()
        step, part = parts[o]
        part.kept.discard(u)
        shown[id(step)] = step.render()
    texts = [shown[id(s)] for s in steps if shown[id(s)]]  # a step with nothing shown is left out
    return "\n".join([RECORD_HEADER] + ([note()] if omitted else []) + texts)


def result_excerpts(
    blocks: Sequence[Block], current: Sequence[Block], budget_chars: int, known: Sequence[Message] = ()
) -> dict[tuple[int, int], str]:
    """The lines of ``blocks``' tool results worth keeping when the rest of
    each block stays whole (``excerpt_masking``: the agent's turns kept, its
    tool outputs masked): chosen as the record chooses them (``excerpts.choose``,
    recent steps and those like ``current`` first) within ``budget_chars``,
    adding to what ``current``, ``known`` and the blocks' other messages hold.
    Keyed by (block index, message index); a result with nothing kept is absent."""
    steps = [_Step(i, b) for i, b in enumerate(blocks)]
    scores = relevance(blocks, current)
    parts = [  # a tool's output only: another message is never masked, so it has no place for lines
        (step, part)
        for step, block in zip(steps, blocks)
        for part in step.parts
        if part.kind == "result" and block.messages[part.source].get("role") in TOOL_ROLES
    ]
    results = {(step.number, part.source) for step, part in parts}
    held = [m for b in current for m in b.messages] + list(known)
    held += [m for i, b in enumerate(blocks) for j, m in enumerate(b.messages) if (i, j) not in results]
    picks = choose(
        [part.units for _, part in parts],
        [_weight(scores[step.number], len(blocks) - step.number) for step, _ in parts],
        words("\n".join(_held_text(m) for m in held)),
        budget_chars,
    )
    for o, u in picks:
        parts[o][1].kept.add(u)
    shown = {(step.number, part.source): part.render() for step, part in parts}
    return {key: text.removeprefix("result: ") for key, text in shown.items() if text}


def without_echoes(text: str) -> str:
    """``text`` (a memory message, say) without the record's items that copy
    the agent's own calls and words: each runs from its line ``  called ...``
    or ``  agent: ...`` up to the next item (``  user: ``, ``  result: ``,
    another echo), step, record, memory or empty line. Everything else stays,
    the summary included."""
    kept: list[str] = []
    echo = False
    for line in text.split("\n"):
        if line.startswith("    "):
            pass  # an item's continuation (a blank line of a call, too) stays with its item
        elif line.startswith("  ") and line[2:].startswith(ITEM_MARKS):
            echo = line[2:].startswith(ECHO_MARKS)
        elif not line.strip() or line.startswith(("step ", "[memory ", RECORD_HEADER)):
            echo = False
        if not echo:
            kept.append(line)
    return "\n".join(kept)


SPENDING_PARTS = ("summary", "calls", "agent", "user", "results", "framing")
"""What a memory's characters carry (``spending``)."""
_ITEM_PARTS = {"called ": "calls", "agent: ": "agent", "user: ": "user", "result: ": "results"}
_MEMORY_LABEL = re.compile(r"\[memory \d+\] ")


def spending(text: str) -> dict[str, int]:
    """Characters of a memory message (``memory_message``'s) by what they
    carry: the summary; the record's copies of the agent's calls and words;
    the user's turns; result excerpts; and framing (headers, memory and step
    labels, the note of omitted steps). A line continues the item above it
    when indented under it, as ``render`` writes it."""
    spent = dict.fromkeys(SPENDING_PARTS, 0)
    in_record, part = False, "framing"
    for line in text.split("\n"):
        size = len(line) + 1
        label = _MEMORY_LABEL.match(line)
        if label:  # a memory begins: a summary, or a record alone
            spent["framing"] += label.end()
            line, size = line[label.end() :], size - label.end()
            in_record, part = False, "summary"
        if line.startswith(RECORD_HEADER):
            in_record, part = True, "framing"
        elif in_record and line.startswith("  ") and line[2:].startswith(tuple(_ITEM_PARTS)):
            part = next(p for mark, p in _ITEM_PARTS.items() if line[2:].startswith(mark))
        elif in_record and not line.startswith("    "):
            part = "framing"  # a step label or the note of omitted steps
        spent[part] += size  # before any label: the message header
    return spent
