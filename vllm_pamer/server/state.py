"""What the plugin keeps in the API server (``app.state.pamer``): settings,
sessions, the policies, the store, the engine services and the capture inbox."""

from __future__ import annotations

import logging
from argparse import Namespace
from typing import Any

import msgspec

from vllm_pamer.adapters.serving import api_keys, key_check
from vllm_pamer.channel import CaptureInbox, CaptureRecord, ensure_channel_address
from vllm_pamer.core.blocks import Message
from vllm_pamer.core.policies import MemoryPolicy, PolicyContext, UnknownPolicy, create_variant, policy_class
from vllm_pamer.core.render import render_tools_as_text, template_supports_tools
from vllm_pamer.core.store import StoreError
from vllm_pamer.core.tokens import TokenCounter
from vllm_pamer.embedders import DEFAULT_EMBEDDER, make_embedder
from vllm_pamer.server import metrics
from vllm_pamer.server.access import Access
from vllm_pamer.server.services import VllmEngineServices
from vllm_pamer.server.sessions import SessionRegistry, SessionState
from vllm_pamer.settings import Settings
from vllm_pamer.stores import open_store

logger = logging.getLogger("vllm_pamer.server")

CAPTURE_LIFETIME_S = 3600.0  # a request may wait long in the queue before its prefill


class ServerState:
    def __init__(self, settings: Settings, engine_client: Any, args: Namespace) -> None:
        self.settings = settings
        self.engine_client = engine_client
        self.args = args
        keys = api_keys(args)
        self.access = Access(keys, key_check(keys), settings)
        self.sessions = SessionRegistry()
        self.api_processes = int(getattr(args, "api_server_count", None) or 1)
        self.inbox = CaptureInbox(ensure_channel_address(), on_record=lambda _: metrics.CAPTURE_RECORDS.inc())
        self.has_heads = bool(settings.heads)
        self._policies: dict[str, MemoryPolicy] = {}
        self.default_policy = self.policy(settings.default_policy, settings.policy_options)
        tokenizer = engine_client.renderer.get_tokenizer()
        self.tools_as_text = not template_supports_tools(getattr(tokenizer, "chat_template", None))
        self.counter = TokenCounter(tokenizer, render=self.render)
        model_config = engine_client.model_config
        fingerprint = str(model_config.served_model_name or model_config.model)
        self.store = open_store(settings.store_location, model_fingerprint=fingerprint, limits=settings.store_limits)
        embedder = None
        if settings.embedder != DEFAULT_EMBEDDER:
            embedder = make_embedder(settings.embedder, check=True).load()  # load now, not on a request
        self.services = VllmEngineServices(
            engine_client,
            self.counter,
            self.inbox,
            model_config.max_model_len,
            settings.capture_wait_s,
            settings.summary_concurrency,
            embedder,
        )
        self.context = PolicyContext(self.store, self.services)
        self.sessions.on_evict = self.services.drop_memories

    def policies_made(self) -> set[str]:
        """The policies this process has made (the others hold nothing in flight)."""
        return set(self._policies)

    def policy(self, name: str, options: dict | None = None) -> MemoryPolicy:
        """The policy instance for ``name`` (created once; raises UnknownPolicy)."""
        if name not in self._policies:
            if options is None:
                options = self.settings.options_by_policy.get(name)
            cls = policy_class((options or {}).get("policy", name))
            if cls.requires_heads and not self.has_heads:
                raise UnknownPolicy(
                    f"policy {name!r} needs a heads file for the served model (--pamer-heads); none is loaded"
                )
            self._policies[name] = create_variant(name, options)
        return self._policies[name]

    def render(self, messages: list[Message]) -> list[Message]:
        """An agent's messages as the template reads them (tools as text for
        templates without tool support)."""
        return render_tools_as_text(messages) if self.tools_as_text else messages

    def prompt_tokens(
        self, messages: list[Message], template_kwargs: dict | None = None, tools: list[dict] | None = None
    ) -> int | None:
        """Prompt tokens of rendered ``messages`` as the engine counts them
        (``tools`` as vLLM hands them to the template); None when the template
        refuses them (the engine then answers the request with its own error)."""
        try:
            return self.counter.request(messages, tools, template_kwargs, rendered=True)
        except Exception:
            logger.debug("token count failed", exc_info=True)
            return None

    async def peek_session(self, key: str) -> SessionState | None:
        """The session's newest state without marking it used (the session route)."""
        return await self.newer_stored(key) or self.sessions.get(key)

    async def newer_stored(self, key: str) -> SessionState | None:
        """The store's state of the session where it is newer than this
        process's; the store is read when this process has none (a restart, a
        failover) and on every request where others write it too (a shared
        store, several API processes)."""
        known = self.sessions.get(key)
        if known is not None and not (self.store.shared or self.api_processes > 1):
            return None
        try:
            stored = await self.store.session_state(key)
        except StoreError:
            logger.warning("vllm-pamer: reading the state of a session failed", exc_info=True)
            return None
        if stored is None or (known is not None and stored[1] <= known.updated):
            return None
        try:
            return SessionState.decode(stored[0])
        except msgspec.DecodeError:
            logger.warning("vllm-pamer: a stored session state does not decode; ignored")
            return None

    async def on_capture(self, key: str, session: SessionState | None, policy: MemoryPolicy) -> CaptureRecord | None:
        """Wait for a request's capture; file its vote on the session and let
        the policy act on it (e.g. start a summary while the agent works)."""
        record = await self.inbox.wait_for(key, CAPTURE_LIFETIME_S)
        if record is not None and session is not None:
            session.record_capture(record)
            await self.store.save_session_state(session.session_id, session.encode(), session.updated)
            if session.last_vote is not None:
                try:
                    await policy.on_vote(session.session_id, session.last_vote, self.context)
                except Exception:
                    logger.exception("policy %s failed to act on a vote", policy.name)
        return record
