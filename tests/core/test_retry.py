"""Retries of engine calls (``core/retry.py``): errors are retried, a timeout is not."""

from __future__ import annotations

import asyncio

import pytest

from vllm_pamer.core.retry import with_retries


def calls_that(outcomes: list):
    """A call that takes each outcome in turn: an exception to raise, a delay (s) to sleep, or a value."""
    made = []

    async def call():
        made.append(len(made))
        outcome = outcomes[min(len(made) - 1, len(outcomes) - 1)]
        if isinstance(outcome, Exception):
            raise outcome
        if isinstance(outcome, float):
            await asyncio.sleep(outcome)
        return outcome

    return call, made


def test_an_error_is_retried_until_an_attempt_succeeds():
    call, made = calls_that([ConnectionError("down"), ConnectionError("down"), "ok"])
    assert asyncio.run(with_retries(call, 1.0, 3, "summary")) == "ok"
    assert len(made) == 3


def test_errors_on_every_attempt_fail_with_the_last_one():
    call, made = calls_that([ConnectionError("down")])
    with pytest.raises(RuntimeError, match="after 4 attempts: ConnectionError: down"):
        asyncio.run(with_retries(call, 1.0, 4, "summary"))
    assert len(made) == 4


def test_a_timed_out_attempt_is_not_retried():
    call, made = calls_that([5.0, "ok"])
    with pytest.raises(RuntimeError, match=r"timed out after 0\.05 s"):
        asyncio.run(with_retries(call, 0.05, 8, "summary"))
    assert len(made) == 1
