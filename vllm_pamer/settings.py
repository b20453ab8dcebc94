"""The plugin's settings: one typed object for every ``PAMER_*`` variable and
every ``vllm-pamer serve --pamer-*`` flag.

vLLM has no plugin flags, so settings reach every vLLM process (API server,
EngineCore, workers) through environment variables, which child processes
inherit: ``PAMER_<FIELD>``. ``vllm-pamer serve`` sets them from its flags,
``--pamer-<field>`` (bools: ``--pamer-<field>`` / ``--pamer-no-<field>``);
with plain ``vllm serve`` set them yourself.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec

from vllm_pamer.core.fields import field_docs
from vllm_pamer.core.store import StoreLimits

ENV_PREFIX = "PAMER_"
_JSON_FIELDS = ("policy_options", "options_by_policy", "store_limits")
_FALSE = ("0", "false", "no", "off")
CHEAP_POLICIES = ("none", "recent_k")
"""Policies any client may name by default: they make no engine request of
their own, keep no memory and break little of the prefix cache."""


def _bool_fields(cls: type[msgspec.Struct]) -> set[str]:
    """Fields that are on / off switches (flags ``--pamer-<field>`` / ``--pamer-no-<field>``)."""
    return {f.name for f in msgspec.structs.fields(cls) if f.type is bool}


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    policy: str | None = None
    """Memory policy of requests that name none. Unset: ``pamer`` when a heads
    file is configured, else ``none``."""
    policy_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Options of that policy, a JSON object."""
    options_by_policy: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    """Options of policies that requests choose by name, a JSON object such as
    ``{"sam": {"page_tokens": 1024}}``; an entry with a ``policy`` key is a
    named variant (``{"recent_10": {"policy": "recent_k", "k": 10}}``)."""
    heads: str | None = None
    """Heads file (safetensors) evaluated on every captured state; the embedded
    model's trained heads when it is served and none is given."""
    capture: bool = True
    """Capture the final-norm state of the last prompt token at every prefill."""
    capture_wait_s: float = 2.0
    """How long a finished response, or an embedding, waits for its capture
    record before it counts as not captured."""
    capture_layers: str | None = None
    """Also tap these decoder blocks (1-based, e.g. ``4,8,15,22``), the final
    norm, last token and prompt mean: the depth diagnostic of ``vllm-pamer
    extract --layers``; needs eager execution."""
    summary_concurrency: Annotated[int, msgspec.Meta(ge=1)] = 2
    """Summaries the engine runs at once for all sessions together; the others
    wait their turn (outside their time limit). Side by side under a KV budget
    that binds, summaries recompute their prefixes and time out together
    (``benchmarks/HISTORY.md``, "The budget schedule under a KV budget that
    binds: a stall")."""
    memory_rows: Annotated[int, msgspec.Meta(ge=0)] = 16384
    """Memory embeddings the worker holds for recall, all sessions together,
    beside the capture (``worker/memory.py``): allocated when the model is
    built, so the engine sizes its KV cache around them; 0 keeps recall in the
    API server. Beyond them the API server scores the rest."""
    embedder: str = "served"
    """Memory embedder: ``served`` (the served model's own final-norm state) or
    ``minilm`` (all-MiniLM-L6-v2 on the CPU)."""
    store: str | None = None
    """Where the session memories live: a SQLite file (default
    ``<cache>/memory.sqlite3``), or a ``postgresql://`` URL of a database that
    several replicas share (``stores/postgres.py``)."""
    store_limits: StoreLimits = msgspec.field(default_factory=StoreLimits)
    """Caps and retention of the store, a JSON object of ``StoreLimits``
    fields (``core/store.py``), e.g. ``{"session_memories": 256}``."""
    cache: str | None = None
    """Root of the converted default model, demo heads and logs (default
    ``~/.cache/vllm-pamer``)."""
    channel: str | None = None
    """Worker -> API server capture channel (a ZeroMQ address); the first
    process that loads the plugin picks a fresh ``ipc://`` path."""
    tenant_header: str | None = None
    """Header that names the tenant a request belongs to, set by a trusted
    proxy in front of the server (``server/access.py``). Unset: the request's
    API key is its tenant when the server has keys (``--api-key``), else every
    client is one tenant."""
    session_headers: str | None = None
    """Other request headers that name a session, comma-separated, read in
    order after ``X-Session-ID`` (for a client or proxy that sends its own
    conversation id header). Unset: ``X-Session-ID`` and the body's
    ``session_id`` only."""
    max_request_bytes: int = 32 * 2**20
    """Largest chat request body the plugin reads; a larger one gets HTTP 413."""
    allowed_policies: str | None = None
    """Policies a request may name (``X-Pamer-Policy``), comma-separated, or
    ``*`` for every registered one. Unset: the server's policy, the cheap
    baselines (``CHEAP_POLICIES``) and the variants named in
    ``options_by_policy``."""
    policy_switch: bool = False
    """Let a session's request name another policy than the session's earlier
    requests did (one policy's memories are not another's)."""
    session_routes: bool = True
    """Serve ``GET /pamer/sessions/{id}`` (read-only, the caller's own sessions)."""

    @property
    def default_policy(self) -> str:
        return self.policy or ("pamer" if self.heads else "none")

    @property
    def client_policies(self) -> frozenset[str] | None:
        """The policies a request may name (None: every registered one)."""
        if self.allowed_policies is not None and self.allowed_policies.strip() == "*":
            return None
        if self.allowed_policies is not None:
            return frozenset(p.strip() for p in self.allowed_policies.split(",") if p.strip())
        return frozenset({self.default_policy, *CHEAP_POLICIES, *self.options_by_policy})

    @property
    def cache_root(self) -> Path:
        return Path(self.cache) if self.cache else Path.home() / ".cache" / "vllm-pamer"

    @property
    def store_location(self) -> str:
        """``store``, or the SQLite file under the cache root."""
        return self.store or str(self.cache_root / "memory.sqlite3")

    @staticmethod
    def env_name(field: str) -> str:
        return ENV_PREFIX + field.upper()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        switches = _bool_fields(cls)
        for field in cls.__struct_fields__:
            raw = env.get(cls.env_name(field))
            if raw is None or raw == "":
                continue
            if field in _JSON_FIELDS:
                try:
                    values[field] = json.loads(raw)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{cls.env_name(field)} is not JSON: {exc}") from None
            elif field in switches:
                values[field] = raw.lower() not in _FALSE
            else:
                values[field] = raw
        try:
            return msgspec.convert(values, cls, strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"bad PAMER_* setting: {exc}") from None

    @property
    def session_header_names(self) -> tuple[str, ...]:
        """The headers that name a session, in the order they are read (lower case)."""
        extra = [name.strip().lower() for name in (self.session_headers or "").split(",") if name.strip()]
        return ("x-session-id", *[name for name in extra if name != "x-session-id"])

    def to_env(self) -> dict[str, str]:
        """The variables that carry these settings (unset fields are left out)."""
        env = {}
        for field in self.__struct_fields__:
            value = getattr(self, field)
            if value is None:
                continue
            if field in _JSON_FIELDS:
                value = json.dumps(msgspec.to_builtins(value))
            elif isinstance(value, bool):
                value = "1" if value else "0"
            env[self.env_name(field)] = str(value)
        return env

    # -- command-line flags ----------------------------------------------------------
    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser) -> None:
        """``--pamer-<field>`` for every field, each defaulting to unset."""
        docs, switches = field_docs(cls), _bool_fields(cls)
        for field in cls.__struct_fields__:
            flag = "--pamer-" + field.replace("_", "-")
            help_text = docs.get(field, "").replace("%", "%%")
            if field in switches:
                parser.add_argument(flag, dest=field, action="store_const", const=True, default=None, help=help_text)
                # the documented spelling; the one of earlier versions (underscores) still parses
                negations = dict.fromkeys(["--pamer-no-" + field.replace("_", "-"), "--pamer-no-" + field])
                parser.add_argument(*negations, dest=field, action="store_const", const=False, help=argparse.SUPPRESS)
            else:
                parser.add_argument(flag, dest=field, default=None, help=help_text)

    def with_flags(self, namespace: argparse.Namespace) -> Settings:
        """These settings overridden by the flags given on the command line."""
        values = msgspec.structs.asdict(self)
        for field in self.__struct_fields__:
            given = getattr(namespace, field, None)
            if given is None:
                continue
            if field in _JSON_FIELDS:
                try:
                    given = json.loads(given)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"--pamer-{field.replace('_', '-')} is not JSON: {exc}") from None
            elif field == "heads":
                given = str(Path(given).resolve())
            values[field] = given
        try:
            return msgspec.convert(values, type(self), strict=False)
        except msgspec.ValidationError as exc:
            raise ValueError(f"bad --pamer-* flag: {exc}") from None
