"""The verbatim record of archived steps: what a memory keeps besides its
summary, so exact values survive a compaction whatever the summarizer writes.

For each archived block, in order: the agent's tool calls with their exact
arguments (a very long one, a file written inline, keeps its beginning and
end) and what the user said (instructions, corrections), verbatim; then,
as the character budget allows, the beginning of every tool result, and whole
results for the steps most like the current work (the blocks kept raw), as
the PaMER paper found restored raw steps worth more than summaries. A result
that does not fit whole keeps its beginning and its end. When even the calls
do not fit, the oldest steps are left out, and the record says so. It is
readable text, never a list of extracted values. The newest step is never
left out: when it alone is too long, its calls and user turns keep their
beginning and end.
"""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence

from vllm_pamer.core.blocks import Block, Message
from vllm_pamer.core.text import cap_head_and_tail

RECORD_HEADER = "Record of the archived steps (tool calls exactly, user turns verbatim, result excerpts):"
HEAD_EXCERPT = 120
"""Characters of every result's beginning the record keeps when it has room."""
_WORD = re.compile(r"[A-Za-z0-9_./-]{3,}")


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


def _one_line(text: str) -> str:
    return " ".join(text.split())


AGENT_CHARS = (400, 160, 0)
"""The agent's own words kept per step, longest first; the record shortens
them before it leaves any step out."""
CALL_CHARS = (0, 1500)
"""Characters each tool call keeps (0: whole), tried in turn after the agent's
words: a long call (a file written inline) keeps its beginning and end, so it
does not push whole earlier steps out. User turns stay whole."""
GAP = " [...] "
"""Where the record left out the middle of a call or result."""


LINE_CHARS_MIN = 80
"""Characters a call or user turn keeps, at the least, when the newest step alone is too long."""

ECHO_MARKS = ("called ", "agent: ")
"""How the record's items that copy the agent's own calls and words begin
(after a step's two-space indent); an evaluation that credits only what the
agent observed drops them (``without_echoes``)."""
ITEM_MARKS = (*ECHO_MARKS, "user: ", "result: ")
"""Every item of a step; an item runs until the next item or step."""


class _Step:
    """One archived block: the agent's words, its calls, the user's turns, its results."""

    def __init__(self, number: int, block: Block) -> None:
        self.number = number
        self.lines: list[tuple[str, str]] = []  # (kind, text) in order: agent / call / user
        self.results: list[str] = []
        for message in block.messages:
            role = message.get("role")
            text = _text(message.get("content")).strip()
            if role == "assistant":
                if text:
                    self.lines.append(("agent", _one_line(text)))
                self.lines += [("call", _call_line(c)) for c in message.get("tool_calls") or [] if isinstance(c, dict)]
            elif role == "user" and text:
                self.lines.append(("user", f"user: {text}"))
            elif text:  # a tool (or function) result
                self.results.append(text)
        self.agent_chars = AGENT_CHARS[0]
        self.call_chars = CALL_CHARS[0]
        """Characters of each call shown (0: whole)."""
        self.line_chars = 0
        """Characters of each call and user turn of the newest step alone (0: whole)."""
        self.excerpt = [len(r) for r in self.results]
        """Characters of each result shown (0: left out)."""

    def render(self) -> str:
        lines = [f"step {self.number}:"]
        for kind, text in self.lines:
            chars = self.line_chars or (self.call_chars if kind == "call" else 0)
            if kind != "agent":  # a line of a multi-line turn or call continues indented, as a result's
                shown = cap_head_and_tail(text, chars, GAP) if chars else text
                lines.append("  " + shown.replace("\n", "\n    "))
            elif self.agent_chars:
                lines.append(f"  agent: {cap_head_and_tail(text, self.agent_chars, GAP)}")
        for result, chars in zip(self.results, self.excerpt):
            if chars:
                lines.append("  result: " + cap_head_and_tail(result, chars, GAP).replace("\n", "\n    "))
        return "\n".join(lines)


def _words(messages: Sequence[Message]) -> Counter[str]:
    return Counter(w.lower() for m in messages for w in _WORD.findall(_text(m.get("content"))))


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


def step_record(blocks: Sequence[Block], current: Sequence[Block], budget_chars: int, first_step: int = 1) -> str:
    """The record of ``blocks`` (numbered from ``first_step``) within
    ``budget_chars``; ``current`` (the blocks that stay raw) decides which
    steps' results are kept whole."""
    steps = [_Step(first_step + i, b) for i, b in enumerate(blocks)]
    scores = relevance(blocks, current)
    omitted = 0

    def note() -> str:
        return f"(steps {first_step}-{first_step + omitted - 1} omitted for space)" if omitted else ""

    def size() -> int:
        return len(RECORD_HEADER) + len(note()) + 1 + sum(len(s.render()) + 1 for s in steps)

    # 1. the skeleton: the calls and user turns of every step, the agent's words then long
    #    calls shortened, then the oldest steps dropped if even that is too long
    full = {id(s): list(s.excerpt) for s in steps}
    for step in steps:
        step.excerpt = [0] * len(step.results)
    for chars in AGENT_CHARS[1:]:
        if size() <= budget_chars:
            break
        for step in steps:
            step.agent_chars = chars
    for chars in CALL_CHARS[1:]:
        if size() <= budget_chars:
            break
        for step in steps:
            step.call_chars = chars
    while len(steps) > 1 and size() > budget_chars:
        steps.pop(0)
        omitted += 1
    if steps and size() > budget_chars:  # the newest step alone is too long: shorten its lines
        newest = steps[0]
        longest = max((len(t) for k, t in newest.lines if k != "agent"), default=0)
        newest.line_chars = max(LINE_CHARS_MIN, longest - (size() - budget_chars))
        while newest.line_chars > LINE_CHARS_MIN and size() > budget_chars:
            newest.line_chars = max(LINE_CHARS_MIN, newest.line_chars * 3 // 4)
    # 2. the beginning of every result, oldest first, while there is room
    for step in steps:
        trial = [min(HEAD_EXCERPT, c) for c in full[id(step)]]
        previous, step.excerpt = step.excerpt, trial
        if size() > budget_chars:
            step.excerpt = previous
            break
    # 3. whole results, the steps most like the current work (then the newest) first; one
    #    that does not fit whole gets the room left, cut at its middle
    for step in sorted(steps, key=lambda s: (-scores[s.number - first_step], -s.number)):
        previous = step.excerpt
        step.excerpt = full[id(step)]
        if size() <= budget_chars:
            continue
        step.excerpt = previous
        room = budget_chars - size()
        if room > HEAD_EXCERPT and step.results:
            extra = room // len(step.results)
            step.excerpt = [min(f, p + max(0, extra)) for f, p in zip(full[id(step)], previous)]
            if size() > budget_chars:
                step.excerpt = previous
    return "\n".join([RECORD_HEADER] + ([note()] if omitted else []) + [s.render() for s in steps])


def without_echoes(text: str) -> str:
    """``text`` (a memory message, say) without the record's items that copy
    the agent's own calls and words: each runs from its line ``  called ...``
    or ``  agent: ...`` up to the next item (``  user: ``, ``  result: ``,
    another echo), step, record, memory or empty line. Everything else stays,
    the summary included."""
    kept: list[str] = []
    echo = False
    for line in text.split("\n"):
        if line.startswith("  ") and line[2:].startswith(ITEM_MARKS):
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
