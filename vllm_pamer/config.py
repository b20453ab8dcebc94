"""Plugin settings, typed, with defaults.

vLLM has no plugin flags, so settings reach every vLLM process (API server,
EngineCore, workers) through environment variables, which child processes
inherit. ``vllm-pamer serve`` sets them from its own flags; with plain
``vllm serve`` set them yourself.
"""

from __future__ import annotations

import json
import os
from typing import Any

import msgspec

ENV_PREFIX = "PAMER_"


class PamerConfig(msgspec.Struct, frozen=True, kw_only=True):
    policy: str | None = None
    """Memory policy applied to requests that name none (``PAMER_POLICY``).
    Unset: ``pamer`` when a heads file is configured, else ``none``."""
    policy_options: dict[str, Any] = msgspec.field(default_factory=dict)
    """Options of that policy as JSON (``PAMER_POLICY_OPTIONS``)."""
    options_by_policy: dict[str, dict[str, Any]] = msgspec.field(default_factory=dict)
    """Options of policies that requests choose by name, e.g. ``{"sam":
    {"page_tokens": 1024}}`` (``PAMER_OPTIONS_BY_POLICY``); the default
    policy takes ``policy_options``."""
    heads: str | None = None
    """Heads file (safetensors) evaluated on every captured state (``PAMER_HEADS``)."""
    capture_wait_s: float = 2.0
    """How long a finished response waits for its capture record before it is
    reported as not captured (``PAMER_CAPTURE_WAIT_S``)."""
    embedder: str = "served"
    """Memory embedder (``PAMER_EMBEDDER``): ``served`` (the served model's own
    final-norm state) or ``minilm`` (all-MiniLM-L6-v2 on the CPU)."""
    store: str | None = None
    """SQLite file of the session memories (``PAMER_STORE``; default
    ``<PAMER_CACHE>/memory.sqlite3``)."""
    capture: bool = True
    """Capture the final state at every completed prefill (``PAMER_CAPTURE``)."""
    capture_layers: str | None = None
    """Also tap these decoder blocks (1-based, e.g. ``"4,8,15,22"``) and the
    final norm, last token and prompt mean (``PAMER_CAPTURE_LAYERS``): the depth
    diagnostic of ``vllm-pamer extract --layers``; needs eager execution."""

    @property
    def default_policy(self) -> str:
        return self.policy or ("pamer" if self.heads else "none")

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> "PamerConfig":
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for field in cls.__struct_fields__:
            raw = env.get(ENV_PREFIX + field.upper())
            if raw is None or raw == "":
                continue
            if field in ("policy_options", "options_by_policy"):
                try:
                    values[field] = json.loads(raw)
                except json.JSONDecodeError as exc:
                    raise ValueError(f"{ENV_PREFIX}{field.upper()} is not JSON: {exc}") from None
            elif field == "capture":
                values[field] = raw.lower() not in ("0", "false", "no", "off")
            else:
                values[field] = raw
        return msgspec.convert(values, cls, strict=False)

    def to_env(self) -> dict[str, str]:
        env = {}
        for field in self.__struct_fields__:
            value = getattr(self, field)
            if value is None:
                continue
            if field in ("policy_options", "options_by_policy"):
                value = json.dumps(value)
            elif isinstance(value, bool):
                value = "1" if value else "0"
            env[ENV_PREFIX + field.upper()] = str(value)
        return env
