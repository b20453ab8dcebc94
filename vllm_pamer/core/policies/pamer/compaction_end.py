"""Every compaction that starts ends with an event: the budget schedule's
``compact`` (``budget_schedule.py``) logs ``compression_started``, and
whatever stops it (an error no fallback rule names, or the client going
away) still logs its end (``core/fallback.py``, ``COMPACTION_ENDS``), so the
event log never holds a compaction that lost track of itself."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from vllm_pamer.core.fallback import Fallback
from vllm_pamer.core.policies.base import PolicyContext, PolicyDecision, PolicyRequest

_Compact = Callable[..., Awaitable[PolicyDecision]]
_ENDED = "_pamer_compaction_ended"
"""Set on an error (or a cancellation) once its compaction's end event is logged."""


def ends_with_an_event(compact: _Compact) -> _Compact:
    """An error of ``compact`` that no fallback rule names still ends the
    compaction with an event (every ``compression_started`` has its end),
    then goes on to the pipeline, which sends the original request; so does
    a cancellation (the client disconnected), which goes on up."""

    @functools.wraps(compact)
    async def guarded(
        schedule: Any, request: PolicyRequest, context: PolicyContext, *args: Any, **kwargs: Any
    ) -> PolicyDecision:
        try:
            return await compact(schedule, request, context, *args, **kwargs)
        except (Exception, asyncio.CancelledError) as exc:
            if not getattr(exc, _ENDED, False):  # a window re-compaction inside it already said so
                setattr(exc, _ENDED, True)
                store, session = context.store, request.session_id
                if isinstance(exc, asyncio.CancelledError):  # the route cancels its handler: nothing is sent
                    await asyncio.shield(store.log_event(session, "compression_abandoned", {"reason": "cancelled"}))
                else:
                    await store.log_event(
                        session, Fallback.POLICY_ERROR.value, {"error": f"{type(exc).__name__}: {exc}"}
                    )
            raise

    return guarded
