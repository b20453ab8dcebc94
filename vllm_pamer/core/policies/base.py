"""The policy interface: one small ABC, typed configs, and a registry.

A policy sees one request of a session (already split into blocks), the vote
and state captured at that session's previous prefill, and the server's store
and engine (``PolicyContext``); it returns the messages to send and the action
it took. Policies never import the engine: ``core/engine.py`` is the contract.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from functools import cached_property
from typing import Any, ClassVar, Literal

import msgspec
import numpy as np

from vllm_pamer.core.blocks import Conversation, Message, Tool, split_conversation
from vllm_pamer.core.engine import EngineServices
from vllm_pamer.core.fallback import Fallback, fallback_rule
from vllm_pamer.core.recall import WorkerRecall
from vllm_pamer.core.store import MemoryStore

MAX_TRACKED_SESSIONS = 10_000
"""Per-session state a policy keeps in memory (LRU beyond this)."""


class HeadVote(msgspec.Struct, frozen=True):
    """What the five heads said about one captured prefill state."""

    head_logits: tuple[float, ...]
    votes: int
    """Heads whose logit passed their threshold."""
    compress_vote: bool
    """At least the heads file's ``min_votes`` heads fired (3 of 5)."""


class PolicyContext(msgspec.Struct, frozen=True):
    """The server's handles a policy works with."""

    store: MemoryStore
    services: EngineServices


class PolicyRequest(msgspec.Struct, frozen=True, kw_only=True, dict=True):
    """One request of a session, as the rewrite pipeline (``core/pipeline.py``)
    and every policy see it: the one typed request, whichever API it came
    through (the server fills it once, ``server/input.py``, and adds what it
    remembers of the session, ``server/routes.py``)."""

    messages: list[Message]
    """The messages as received (the neutral chat view of every managed API)."""
    session_id: str = ""
    """The session's key (empty: the request named none, and is sent as it is)."""
    previous_vote: HeadVote | None = None
    """Vote captured at this session's previous request (the pre-action state)."""
    context: PolicyContext | None = None
    """Store and engine, for policies that keep memories (None: pure rewrites only)."""
    previous_state: np.ndarray | None = None
    """The served model's final-norm state captured at this session's previous
    request (float32 vector; None when none was captured)."""
    tools: list[Tool] | None = None
    """The request's ``tools`` (templates that support them render them into
    the prompt, so they count toward the window)."""
    prompt_tokens: int | None = None
    """Prompt tokens of the request as received (messages and tools, as the
    engine counts them), counted by the server off its event loop; None when
    unknown. Any subset of its messages counts no more."""
    context_budget: int | None = None
    """The request's own context budget in tokens (``X-Pamer-Context-Budget``); None: the policy's."""
    answer_tokens: int | None = None
    """The answer's length the request asks for (``max_completion_tokens`` or
    ``max_tokens``; None: not set): vLLM cuts an answer at the window, so a
    request fits only with room for it."""
    previous_recall: WorkerRecall | None = None
    """The worker's Top-K of the session's memories for ``previous_state``,
    made at its capture (None: not made)."""

    @cached_property
    def conversation(self) -> Conversation:
        """The messages as prefix and blocks (read only after the pipeline's
        protocol check: ``split_conversation`` assumes a whole protocol)."""
        return split_conversation(self.messages)


Trigger = Literal["vote", "top_of_band", "kv_pressure", "window"]
"""Why a compaction schedule compacted a request."""


class ScheduleReport(msgspec.Struct, frozen=True):
    """What a compaction schedule saw and did on one request (the ``pamer``
    report's ``schedule`` object)."""

    budget: int
    """The effective budget."""
    band_low: int
    """Where the band starts."""
    target: int
    """What a compaction brings the request down to."""
    sent_tokens: int
    """Tokens of the request as it would go out without a compaction."""
    trigger: Trigger | None = None
    """Why this request compacted (None: it did not)."""
    cache_break_tokens: int = 0
    """Tokens the previous request had cached after the prefix that this
    request's compaction recomputes."""
    kv_usage: float | None = None
    """The engine's KV-cache usage (0-1) the budget followed."""
    kv_share: int | None = None
    """The session's share of the KV cache (tokens) when it held the budget (``kv_share``)."""
    memory_seconds: float | None = None
    """How long this compaction's memory took to write (None: no compaction)."""
    memory_ahead: bool = False
    """The memory was ready before this request, which did not wait for it (``write_ahead``)."""


class PolicyDecision(msgspec.Struct, frozen=True):
    """What a policy decided for one request, and what the pipeline returns
    (the one typed outcome: a fallback's messages are the original ones)."""

    messages: list[Message]
    action: str
    """``none`` (sent as is), ``rewritten``, ``compressed``, ``recalled``, or
    ``fallback:<rule>`` (made by ``PolicyDecision.fallback``, a rule of
    ``core/fallback.py``)."""
    detail: str = ""
    tokens_inserted: int = 0
    """Tokens of text the policy added (recalled memories), for metrics."""
    extra_tools: tuple[Tool, ...] = ()
    """Tools the server adds to the request and resolves itself through
    ``MemoryPolicy.resolve_tool_call`` (SAM's ``memory`` tool); the client
    never sees their calls."""
    recalled: tuple[int, ...] | None = None
    """Ids of the memories shown, in the order shown (None: no recall), so
    clients can see how stable recall is between requests."""
    schedule: ScheduleReport | None = None
    """What a compaction schedule saw and did (None: the policy has none)."""

    def __post_init__(self) -> None:
        fallback_rule(self.action)  # a fallback names a rule of core/fallback.py (ValueError otherwise)

    @classmethod
    def fallback(
        cls, original: list[Message], rule: Fallback, detail: str = "", schedule: ScheduleReport | None = None
    ) -> PolicyDecision:
        """Send ``original`` (the request as the agent sent it) by ``rule``."""
        return cls(original, rule.action, detail, schedule=schedule)

    @property
    def fallback_rule(self) -> Fallback | None:
        return fallback_rule(self.action)


class PolicyConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base of every policy's config (msgspec struct with defaults)."""


class MemoryPolicy(ABC):
    """Base class of every memory policy."""

    name: str
    """Registry name (a variant instance carries its own)."""
    config_cls: ClassVar[type[PolicyConfig]] = PolicyConfig
    requires_heads: ClassVar[bool] = False
    """True when the policy cannot decide without trained heads for the model."""
    counts_prompt: ClassVar[bool] = True
    """The server counts each request's prompt tokens before the policy runs
    (``PolicyRequest.prompt_tokens``); a policy that never rewrites needs no
    count, and its report takes the engine's own (the capture's)."""

    def __init__(self, config: PolicyConfig | None = None) -> None:
        self.config = config if config is not None else self.config_cls()

    @classmethod
    def config_classes(cls) -> tuple[type[PolicyConfig], ...]:
        """Every config type the policy takes (PaMER has one per schedule)."""
        return (cls.config_cls,)

    @classmethod
    def make_config(cls, options: dict[str, Any]) -> PolicyConfig:
        """The policy's config from plain options; raises ``msgspec.ValidationError``
        or ``ValueError`` for options it does not take."""
        return msgspec.convert(options, cls.config_cls)

    @abstractmethod
    async def rewrite(self, request: PolicyRequest) -> PolicyDecision:
        """Return the messages to send for this request."""

    def needs_context(self, request: PolicyRequest) -> PolicyContext:
        """The request's store and engine; a policy that keeps memories calls it."""
        if request.context is None:
            raise RuntimeError(f"policy {self.name!r} needs a memory store and engine services")
        return request.context

    async def resolve_tool_call(self, session_id: str, name: str, arguments: str, context: PolicyContext) -> str:
        """The result of a call to one of this policy's ``extra_tools``, as the
        tool message's content. Errors the model can fix are returned as text."""
        raise NotImplementedError(f"policy {self.name!r} has no tools")

    async def on_vote(self, session_id: str, vote: HeadVote, context: PolicyContext) -> None:  # noqa: B027 - optional hook
        """Called when the vote of a session's request arrives (at its prefill,
        before the response ends). Must return quickly; default: nothing."""

    def in_flight(self, session_id: str) -> dict[str, Any] | None:
        """A memory this process is writing ahead for the session (the session
        route shows it); None: none (the default)."""
        return None


class UnknownPolicy(ValueError):
    pass


_REGISTRY: dict[str, type[MemoryPolicy]] = {}


def register_policy(cls: type[MemoryPolicy]) -> type[MemoryPolicy]:
    """Class decorator: make a policy selectable by its ``name``."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"policy name {cls.name!r} is already registered")
    _REGISTRY[cls.name] = cls
    return cls


def available_policies() -> list[str]:
    return sorted(_REGISTRY)


def policy_class(name: str) -> type[MemoryPolicy]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownPolicy(f"unknown memory policy {name!r}; available: {', '.join(available_policies())}") from None


def create_variant(name: str, options: dict[str, Any] | None = None) -> MemoryPolicy:
    """A policy under its own name: ``options`` may name the registered policy
    it configures (``{"policy": "recent_k", "k": 10}`` as ``recent_10``), so
    variants of one policy can be served and compared side by side."""
    options = dict(options or {})
    base = options.pop("policy", name)
    if base != name and name in _REGISTRY:
        raise ValueError(f"variant {name!r} would hide the registered policy of that name")
    policy = create_policy(base, options)
    policy.name = name  # reports and metrics show the variant's name
    return policy


def create_policy(name: str, options: dict[str, Any] | None = None) -> MemoryPolicy:
    """Build a policy from its name and a plain dict of options (validated)."""
    cls = policy_class(name)
    try:
        config = cls.make_config(options or {})
    except (msgspec.ValidationError, ValueError) as exc:
        raise ValueError(f"bad options for policy {name!r}: {exc}") from None
    return cls(config)
