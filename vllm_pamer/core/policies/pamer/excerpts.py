"""Which lines of archived steps a record keeps: the ones that carry the
most words the request would otherwise not hold, per character.

``record.py`` cuts each part of an archived step into *units*: the lines of
a tool result (a long line in pieces, a JSON result one line per object with
its fields as ``key: value``: its braces and quotes carry nothing), the
sentences of the agent's words, and each tool call whole. Each word of a
unit has a weight: its rarity among the archived parts (a word in every
result names nothing), twice as much for a word shaped like a name
(``snake_case``, ``CamelCase``, a path, a dotted name, letters and digits
mixed: exact names are what a summary loses first), scaled by its step's
recency and likeness to the current work (``record.py``), and nothing when
the request holds it anyway (the prefix, the blocks kept raw, the user's
turns) or an earlier choice already carries it. Units are taken greedily by
weight gained per character until the room is spent (the gain of a unit
only falls as others are taken, so a lazy greedy pass is exact). The same
file shown twice, a directory listing repeated, a long log of one repeated
line all add little and lose to the line that holds a name seen nowhere
else.

It reads only the session's own history at the compaction: never the steps
that follow, and nothing of the evaluation (``replay/evidence.py``,
``salient.py``): no list of values is extracted, whole lines are kept.
"""

from __future__ import annotations

import heapq
import json
import math
import re
from collections import Counter
from collections.abc import Iterable, Sequence

WORD = re.compile(r"[A-Za-z0-9_./-]{3,}")
"""A word: runs of letters, digits and the characters of paths and dotted names."""
LINE_CHARS = 240
"""A unit's most characters: a longer line is cut into pieces at spaces."""
UNIT_COST = 11
"""Characters a unit costs beside its own: its indent and newline, and the
mark of a gap after it; so a run of very short lines does not win on its
length alone."""


def words(text: str) -> set[str]:
    return {w.lower() for w in WORD.findall(text)}


_NAMED = re.compile(r"[a-z][A-Z]|[A-Za-z][_./][A-Za-z0-9]|[A-Za-z][0-9]|[0-9][A-Za-z]")
"""The shape of a name rather than a word: snake_case, CamelCase, a path, a
dotted name, letters and digits mixed."""
NAME_WEIGHT = 2.0
"""How much more a name-shaped word counts than a plain one: exact names are
what a summary loses first, and what a later step types again."""


def _shape_weight(word: str) -> float:
    return NAME_WEIGHT if _NAMED.search(word) else 1.0


def _inline(value: object) -> str:
    """A JSON value on one line, without its quotes."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_inline(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_inline(v) for v in value) + "]"
    return str(value)


def _flat(value: object, key: str = "") -> list[str]:
    """A JSON value as lines, without its quotes: an object on one line, a
    field too long for one line (a list of objects, a map of them) on lines
    of its own after it, one per element, each led by its field's name."""
    label = f"{key}: " if key else ""
    if isinstance(value, list) and len(_inline(value)) > LINE_CHARS:
        return [line for v in value for line in _flat(v, key)]
    if isinstance(value, dict) and len(_inline(value)) > LINE_CHARS:
        short = {k: v for k, v in value.items() if len(_inline(v)) <= LINE_CHARS // 2}
        head = [label + ", ".join(f"{k}: {_inline(v)}" for k, v in short.items())] if short else []
        return head + [line for k, v in value.items() if k not in short for line in _flat(v, k)]
    return [label + (_inline(value)[1:-1] if isinstance(value, dict | list) else _inline(value))]


def pieces(line: str) -> Iterable[str]:
    while len(line) > LINE_CHARS:
        cut = line.rfind(" ", LINE_CHARS // 2, LINE_CHARS)
        cut = cut if cut > 0 else LINE_CHARS
        yield line[:cut]
        line = line[cut:].lstrip()
    if line.strip():
        yield line


def units(text: str) -> list[str]:
    """An observation cut into the units a record may keep, in order."""
    stripped = text.strip()
    if stripped[:1] in "{[":
        try:  # a string value keeps its own lines (a tool's output wrapped in JSON)
            lines = [line for flat in _flat(json.loads(stripped)) for line in flat.split("\n")]
        except (ValueError, RecursionError):  # not JSON, or nested past what the parser takes
            lines = text.split("\n")
    else:
        lines = text.split("\n")
    return [piece.strip() for line in lines for piece in pieces(line.strip()) if piece.strip()]


def choose(
    observations: Sequence[Sequence[str]],
    weights: Sequence[float],
    known: Iterable[str],
    room: int,
) -> list[tuple[int, int]]:
    """The units to keep within ``room`` characters, as (observation, unit)
    in the order they were chosen (best first). ``observations`` are each
    part's ``units``; ``weights`` (one per part) scale its words; ``known``
    are words the request holds anyway. Ties go the same way in every
    process (words are summed in sorted order)."""
    unit_words = [[sorted(words(u)) for u in units_] for units_ in observations]
    df: Counter[str] = Counter(w for units_ in unit_words for w in set().union(*map(set, units_)))
    shape: dict[str, float] = {}
    for units_ in observations:
        for unit in units_:
            for word in WORD.findall(unit):  # a word's most name-like spelling decides
                shape[word.lower()] = max(shape.get(word.lower(), 1.0), _shape_weight(word))
    value = {w: math.log((1 + len(observations)) / n) * shape[w] for w, n in df.items()}
    covered = {w.lower() for w in known}

    def gain(o: int, u: int) -> float:
        return sum(value[w] for w in unit_words[o][u] if w not in covered) * weights[o]

    def cost(o: int, u: int) -> int:
        return len(observations[o][u]) + UNIT_COST

    heap = [(-gain(o, u) / cost(o, u), o, u) for o, units_ in enumerate(observations) for u in range(len(units_))]
    heapq.heapify(heap)
    chosen: list[tuple[int, int]] = []
    while heap and room > UNIT_COST:
        _, o, u = heapq.heappop(heap)
        score = -gain(o, u) / cost(o, u)
        if score >= 0:
            continue  # nothing new left in it
        if heap and score > heap[0][0]:  # its gain fell since it was scored: back in line
            heapq.heappush(heap, (score, o, u))
            continue
        if cost(o, u) <= room:
            chosen.append((o, u))
            room -= cost(o, u)
            covered.update(unit_words[o][u])
    return chosen
