"""What the endpoint reports beside the answer (``server/output.py``)."""

from __future__ import annotations

from vllm_pamer.channel import CaptureRecord
from vllm_pamer.server.output import PamerReport


def test_report_takes_the_engines_prompt_count_when_the_policy_counted_none():
    record = CaptureRecord(key="k", request_id="r", session_id=None, num_prompt_tokens=321, hidden=b"")
    uncounted = PamerReport(session_id=None, policy="none", action="none")
    uncounted.add_capture(record)
    assert (uncounted.prompt_tokens_in, uncounted.prompt_tokens_out) == (321, 321)
    counted = PamerReport(session_id=None, policy="pamer", action="rewritten", prompt_tokens_in=900)
    counted.prompt_tokens_out = 300
    counted.add_capture(record)  # the policy's own counts stay
    assert (counted.prompt_tokens_in, counted.prompt_tokens_out) == (900, 300)
