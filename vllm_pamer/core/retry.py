"""Bounded retries of an engine call (summaries, embeddings, selector calls)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def with_retries(make_call: Callable[[], Awaitable[T]], timeout_s: float, attempts: int, what: str) -> T:
    """Run ``make_call`` up to ``attempts`` times, each bounded by ``timeout_s``."""
    last: Exception | None = None
    for _ in range(max(1, attempts)):
        try:
            return await asyncio.wait_for(make_call(), timeout_s)
        except Exception as exc:  # every failure, timeouts included, is a retry
            last = exc
    raise RuntimeError(f"{what} failed after {attempts} attempts: {type(last).__name__}: {last}")
