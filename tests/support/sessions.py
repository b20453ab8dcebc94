"""One agent session against a policy, every request awaited in the caller's
event loop, so work a policy leaves in the background (a memory written
ahead, a summary written after its compaction) is a task of that loop."""

from __future__ import annotations

from tests.support.fakes import KEEP
from vllm_pamer.core.pipeline import rewrite_request
from vllm_pamer.core.policies import PolicyContext, PolicyRequest, create_policy


class LoopSession:
    def __init__(self, store, services, options, session="s1", policy="pamer"):
        self.policy = create_policy(policy, options)
        self.context, self.services, self.session = PolicyContext(store, services), services, session

    async def send(self, messages, vote=KEEP):
        """The request as the endpoint passes it: with the server's count of it as received."""
        tokens = self.services.count_tokens(messages)
        request = PolicyRequest(
            messages=messages, session_id=self.session, previous_vote=vote, context=self.context, prompt_tokens=tokens
        )
        return await rewrite_request(self.policy, request)
