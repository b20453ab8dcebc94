"""What the text a policy inserted spends its characters on (issue 31: say
what the memory keeps): per request, the inserted messages' characters by
part (``record.spending``'s parts of a memory message, and the tool outputs
a policy masked), and per policy, the mean inserted characters of an
answered request and their shares."""

from __future__ import annotations

from collections.abc import Sequence

from vllm_pamer.core.blocks import Message
from vllm_pamer.core.policies.pamer.memory import EXCERPT_MARK
from vllm_pamer.core.policies.pamer.record import SPENDING_PARTS, spending
from vllm_pamer.replay.evidence import inserted_messages
from vllm_pamer.replay.records import PolicyRow, StepRecord
from vllm_pamer.salient import message_text

INSERTED_PARTS = (*SPENDING_PARTS, "masked")
"""A memory message's parts (``record.spending``) and ``masked``: the tool
messages a policy sent in place of raw ones (observation masking's placeholders)."""


def inserted_spending(sent: Sequence[Message], history: Sequence[Message]) -> dict[str, int]:
    """Characters of what a policy inserted into ``sent`` for ``history``, by part (``INSERTED_PARTS``)."""
    spent = dict.fromkeys(INSERTED_PARTS, 0)
    for message in inserted_messages(sent, history):
        text = message_text(message)
        if message.get("role") == "tool":  # a placeholder, and the lines kept after it (excerpt_masking)
            placeholder, mark, kept = text.partition(EXCERPT_MARK)
            spent["masked"] += len(placeholder) + 1
            spent["results"] += len(mark + kept)
        elif message.get("role") == "assistant":
            spent["agent"] += len(text) + 1
        else:
            for part, chars in spending(text).items():
                spent[part] += chars
    return spent


def add_spending(rows: Sequence[PolicyRow], records: Sequence[StepRecord]) -> None:
    """Each row's inserted characters per answered request and their shares by part."""
    for row in rows:
        spent = [r.inserted for r in records if r.policy == row.policy and r.status == "ok" and r.inserted is not None]
        totals = {part: sum(s.get(part, 0) for s in spent) for part in INSERTED_PARTS}
        total = sum(totals.values())
        if spent and total:
            row.inserted_chars = total / len(spent)
            row.spending = {part: chars / total for part, chars in totals.items()}


SPENDING_NOTES = """\
What the inserted text spends its characters on (each policy that inserts
any): characters inserted per answered request, and their shares: the
summary, the record's copies of the agent's calls and words, user turns,
result excerpts, framing (headers, labels), tool outputs masked.
"""


def spending_table(rows: Sequence[PolicyRow]) -> str:
    """The ``SPENDING_NOTES`` table; empty when no policy inserted anything."""
    inserting = [row for row in rows if row.inserted_chars and row.spending]
    if not inserting:
        return ""
    lines = [
        "| policy | inserted chars / request | " + " | ".join(INSERTED_PARTS) + " |",
        "|" + "---|" * (2 + len(INSERTED_PARTS)),
    ]
    for row in inserting:
        shares = " | ".join(f"{(row.spending or {}).get(part, 0.0):.1%}" for part in INSERTED_PARTS)
        lines.append(f"| {row.policy} | {row.inserted_chars:,.0f} | {shares} |")
    return "\n".join(lines)
