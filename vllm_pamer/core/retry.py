"""Bounded retries of an engine call (summaries, embeddings, selector calls).

An error is retried; a timeout is not: on an engine too loaded to answer in
time a retry restarts the call's prefill and adds to the load, and the
request that waits on it would stall (``benchmarks/HISTORY.md``, "The budget
schedule under a KV budget that binds: a stall").
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def with_retries(make_call: Callable[[], Awaitable[T]], timeout_s: float, attempts: int, what: str) -> T:
    """Run ``make_call`` up to ``attempts`` times while it fails with an
    error; one attempt that runs past ``timeout_s`` ends the tries."""
    last: Exception | None = None
    for attempt in range(1, max(1, attempts) + 1):
        try:
            return await asyncio.wait_for(make_call(), timeout_s)
        except TimeoutError as exc:
            raise RuntimeError(f"{what} timed out after {timeout_s:g} s (attempt {attempt}; not retried)") from exc
        except Exception as exc:
            last = exc
    raise RuntimeError(f"{what} failed after {attempts} attempts: {type(last).__name__}: {last}")
