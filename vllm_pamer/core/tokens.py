"""The one token count: chat messages through the served chat template.

``ids`` is what a request's prompt is; ``request`` counts a whole request (its
tools as the engine's renderer passes them to the template) and raises what
the template raises; ``span`` counts part of a conversation (a budget or a
gate), falling back to the plain text when the template refuses a partial
conversation. Callers that need another fallback say so where they call.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from vllm_pamer.core.blocks import Message, Tool


class ChatTokenizer(Protocol):
    """A Hugging Face tokenizer with a chat template (what vLLM serves with)."""

    def apply_chat_template(self, conversation: list[Message], **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...


class TokenCounter:
    def __init__(self, tokenizer: ChatTokenizer, render: Callable[[list[Message]], list[Message]] | None = None):
        """``render``: how the server turns an agent's messages into what the
        template reads (``core.render``); None: as they are."""
        self.tokenizer = tokenizer
        self.render: Callable[[list[Message]], list[Message]] = render or list

    def ids(self, messages: Sequence[Message], add_generation_prompt: bool = True, **template_kwargs: Any) -> list[int]:
        """Token ids of already rendered ``messages`` through the chat template."""
        ids = self.tokenizer.apply_chat_template(
            list(messages), tokenize=True, add_generation_prompt=add_generation_prompt, **template_kwargs
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return list(ids)

    def request(
        self,
        messages: Sequence[Message],
        tools: list[Tool] | None = None,
        template_kwargs: dict[str, Any] | None = None,
        *,
        rendered: bool = False,
    ) -> int:
        """Prompt tokens of a chat request as the engine counts them: the
        messages (rendered here unless ``rendered``), the tools, the request's
        template kwargs. Raises what the template raises."""
        sent = list(messages) if rendered else self.render(list(messages))
        return len(self.ids(sent, **{**(template_kwargs or {}), "tools": tools or None}))

    def span(self, messages: Sequence[Message]) -> int:
        """Tokens of part of a conversation (no generation prompt), rendered as
        a request renders it (a template that knows no tools would otherwise
        drop the calls, and blocks would count short)."""
        if not messages:
            return 0
        rendered = self.render(list(messages))
        try:
            return len(self.ids(rendered, add_generation_prompt=False))
        except Exception:  # a template that refuses a partial conversation
            text = "\n".join(str(m.get("content") or "") for m in rendered)
            return len(self.tokenizer.encode(text, add_special_tokens=False))
