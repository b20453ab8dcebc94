"""Writing a summary (``core/policies/summary_writer.py``) with the engine's summary slots."""

from __future__ import annotations

import asyncio

from tests.support.fakes import FakeEngine, conversation
from vllm_pamer.core.blocks import split_conversation
from vllm_pamer.core.policies.summary_writer import SummaryConfig, write_summary


def test_summaries_take_turns_and_the_wait_is_not_part_of_the_time_limit():
    """Two sessions' summaries with one turn at a time: they run one after the
    other, and the second (0.6 s after it was asked, 0.3 s after its turn)
    finishes inside its 0.5 s limit."""
    services = FakeEngine(summary_delay=0.3, slots=1)
    cfg = SummaryConfig(summary_timeout_s=0.5, summary_attempts=1)
    blocks = split_conversation(conversation(4)).blocks

    async def both():
        return await asyncio.gather(write_summary(services, cfg, blocks), write_summary(services, cfg, blocks))

    assert all(s.startswith("SUMMARY") for s in asyncio.run(both()))
    assert services.summaries == 2 and services.most_running == 1
