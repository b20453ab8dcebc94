"""Engine services for the memory controller, all served by the same engine:

* ``summarize`` - an internal chat request (temperature 0, thinking off where
  the template has the switch) whose source is trimmed from the middle until
  the prompt fits the model window; ``summarize_conversation`` - the same for
  chat messages rendered as the server renders an agent's request (so their
  prefix can come from the prefix cache);
* ``embed`` - the served model's own final-norm state at the last token of the
  text: a one-token internal request tagged with a capture key, its state
  read from the capture channel (no second model);
* ``count_tokens`` - the served tokenizer.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np
from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams

from vllm_pamer.channel import CAPTURE_KEY, SESSION_KEY, CaptureInbox
from vllm_pamer.core.policies.pamer import SERVED_STATE_EMBEDDER, cap_head_and_tail, summary_prompt
from vllm_pamer.engine.memory_index import MemoryIndex
from vllm_pamer.server import metrics


class EngineServices:
    embedder_name = SERVED_STATE_EMBEDDER

    def __init__(self, engine_client: Any, tokenizer: Any, inbox: CaptureInbox, max_model_len: int,
                 capture_wait_s: float = 10.0, embedder: Any = None, render: Any = None) -> None:
        """``embedder``: an ``vllm_pamer.embedders.Embedder`` used instead of the
        served model's state (None: the served model). ``render``: how the
        server renders an agent's messages for the template (None: as they are)."""
        self.render = render or list
        self.embedder = embedder
        if embedder is not None:
            self.embedder_name = embedder.name
        self.index = MemoryIndex()
        self.engine_client = engine_client
        self.tokenizer = tokenizer
        self.inbox = inbox
        self.max_model_len = max_model_len
        self.capture_wait_s = capture_wait_s

    # -- token counting --------------------------------------------------------
    def chat_ids(self, messages: Sequence[dict], add_generation_prompt: bool = True, **template_kwargs) -> list[int]:
        """Token ids of ``messages`` through the served chat template."""
        ids = self.tokenizer.apply_chat_template(
            list(messages), tokenize=True, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def request_tokens(self, messages: Sequence[dict], tools: list[dict] | None = None,
                       template_kwargs: dict | None = None) -> int:
        """Prompt tokens of a chat request as the engine counts them: these
        messages (already rendered as the server sends them), the tools as
        vLLM hands them to the template, the request's template kwargs.
        Raises what the template raises."""
        return len(self.chat_ids(messages, **{**(template_kwargs or {}), "tools": tools or None}))

    def prompt_tokens(self, messages: Sequence[dict], tools: list[dict] | None = None) -> int:
        """``request_tokens`` of an agent's messages, rendered here first: what
        a policy's window guard checks against the window."""
        try:
            return self.request_tokens(self.render(list(messages)), tools)
        except Exception:  # a template that refuses the tools or the messages
            return self.count_tokens(messages)

    def count_tokens(self, messages: Sequence[dict]) -> int:
        if not messages:
            return 0
        try:
            return len(self.chat_ids(messages, add_generation_prompt=False))
        except Exception:  # a template that refuses a partial conversation
            text = "\n".join(str(m.get("content") or "") for m in messages)
            return len(self.tokenizer.encode(text, add_special_tokens=False))

    # -- internal requests -------------------------------------------------------
    async def _run(self, prompt_ids: list[int], params: SamplingParams, kind: str) -> str:
        request_id = f"pamer-{kind}-{uuid.uuid4().hex}"
        text, generated = "", 0
        async for output in self.engine_client.generate({"prompt_token_ids": prompt_ids}, params, request_id):
            if output.outputs:
                text = output.outputs[0].text
                generated = len(output.outputs[0].token_ids)
        # the plugin's own tokens count in a policy's total (paper eq. 45)
        metrics.INTERNAL_PROMPT_TOKENS.labels(kind).inc(len(prompt_ids))
        metrics.INTERNAL_COMPLETION_TOKENS.labels(kind).inc(generated)
        return text

    def _answer_budget(self, max_tokens: int) -> tuple[int, int]:
        """(answer tokens, prompt tokens that fit beside them): an internal
        answer takes at most a quarter of the window."""
        max_tokens = min(max_tokens, self.max_model_len // 4)
        return max_tokens, self.max_model_len - max_tokens - 8

    async def summarize(self, source: str, max_tokens: int) -> str:
        max_tokens, budget = self._answer_budget(max_tokens)
        # enable_thinking: the paper writes summaries with thinking off; templates
        # without the switch ignore it.
        ids = self.chat_ids(summary_prompt(source), enable_thinking=False)
        for _ in range(4):  # shrink from the middle until it fits
            if len(ids) <= budget:
                break
            source = cap_head_and_tail(source, int(len(source) * budget / len(ids) * 0.9))
            ids = self.chat_ids(summary_prompt(source), enable_thinking=False)
        else:
            raise RuntimeError(f"summary prompt of {len(ids)} tokens does not fit {budget}")
        return await self._generate(ids, max_tokens, "summary")

    async def summarize_conversation(self, messages: Sequence[dict], max_tokens: int) -> str | None:
        """A summary request made of chat ``messages`` (rendered as the server
        renders requests); None when they do not fit the window."""
        max_tokens, budget = self._answer_budget(max_tokens)
        ids = self.chat_ids(self.render(list(messages)), enable_thinking=False)
        if len(ids) > budget:
            return None
        return await self._generate(ids, max_tokens, "summary")

    async def complete(self, messages: Sequence[dict], max_tokens: int, json_schema: dict | None = None,
                       kind: str = "internal") -> str:
        """An internal chat request (greedy, thinking off); ``json_schema``
        constrains the answer with vLLM's structured outputs."""
        max_tokens, budget = self._answer_budget(max_tokens)
        ids = self.chat_ids(messages, enable_thinking=False)
        if len(ids) > budget:
            raise RuntimeError(f"{kind} prompt of {len(ids)} tokens does not fit the window")
        return await self._generate(ids, max_tokens, kind, json_schema)

    async def _generate(self, ids: list[int], max_tokens: int, kind: str, json_schema: dict | None = None) -> str:
        # no free whitespace: a constrained answer cannot pad itself to max_tokens
        structured = (
            StructuredOutputsParams(json=json_schema, disable_any_whitespace=True) if json_schema is not None else None
        )
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, structured_outputs=structured, extra_args={SESSION_KEY: ""}
        )
        return (await self._run(ids, params, kind)).strip()

    def top_k(self, session: str, query: np.ndarray, memories, k: int):
        """Recall search on the device-resident memory matrix (kernels.cosine_topk)."""
        return self.index.top_k(session, query, memories, k)

    async def embed(self, text: str) -> np.ndarray:
        if self.embedder is not None:
            return await self.embedder.embed(text)
        ids = self.tokenizer.encode(text, add_special_tokens=False)[-(self.max_model_len - 2):] or [0]
        key = uuid.uuid4().hex
        params = SamplingParams(temperature=0.0, max_tokens=1, extra_args={CAPTURE_KEY: key, SESSION_KEY: ""})
        await self._run(ids, params, "embed")
        record = await self.inbox.wait_for(key, self.capture_wait_s)
        if record is None:
            raise RuntimeError("no state was captured for the embedding request")
        return record.hidden_state().copy()
