"""The fallback rules (PaMER paper, Table 15, and this server's own): the one
list of reasons a request goes out as the agent sent it.

A rule is reported as the action ``fallback:<rule>`` (the ``pamer`` report,
the metrics' ``action`` label, the replay's records) and names the store
event a policy logs when it falls back. Adding a rule means adding a member
here; ``core/pipeline.py`` sends the original messages for every one.
"""

from __future__ import annotations

from enum import Enum

FALLBACK_PREFIX = "fallback:"


class Fallback(str, Enum):
    MISSING_SESSION_ID = "missing_session_id"
    """The request named no session."""
    UNSAFE_TOOL_PROTOCOL = "unsafe_tool_protocol"
    """The agent's messages break the tool protocol (a call without its result, ...)."""
    POLICY_ERROR = "policy_error"
    """The policy raised."""
    INVALID_REWRITE = "invalid_rewrite"
    """The policy's messages break the tool protocol or are empty."""
    STORAGE_FAILURE = "storage_failure"
    """A memory store read or write failed."""
    SUMMARY_FAILURE = "summary_failure"
    """A summary (or a SAM cue) could not be written."""
    EMBEDDING_FAILURE = "embedding_failure"
    """A memory's embedding could not be made."""
    RECALL_FAILURE = "recall_failure"
    """Recalling the session's memories failed."""
    UNKNOWN_CONVERSATION = "unknown_conversation"
    """The request continues a conversation (``previous_response_id``) the
    plugin does not hold for its session: vLLM answers the body as sent."""

    @property
    def action(self) -> str:
        """The action a request that fell back by this rule reports."""
        return FALLBACK_PREFIX + self.value


def fallback_rule(action: str) -> Fallback | None:
    """The rule of a ``fallback:<rule>`` action (None: not a fallback).
    Raises ValueError for a fallback that names no rule."""
    if not action.startswith(FALLBACK_PREFIX):
        return None
    return Fallback(action[len(FALLBACK_PREFIX) :])


COMPACTION_ENDS = frozenset(
    {
        "compressed",
        "compression_abandoned",
        Fallback.SUMMARY_FAILURE.value,
        Fallback.EMBEDDING_FAILURE.value,
        Fallback.STORAGE_FAILURE.value,
        Fallback.POLICY_ERROR.value,
    }
)
"""The store events that end a ``compression_started`` (the schedules of
``core/policies/pamer/``): the memory committed, the compaction given up
(nothing stored), or a failure by one of these rules. A start without one
is a compaction that lost track of itself (issue 33)."""
