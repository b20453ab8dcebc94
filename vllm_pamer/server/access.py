"""Who may use the plugin's routes, and whose session a request names.

* **Keys.** Every route the plugin adds honours vLLM's ``--api-key`` (or
  ``VLLM_API_KEY``) by vLLM's own check, whatever its path: vLLM's middleware
  guards only ``/v1``-style paths, and ``/pamer/sessions/{id}`` is not one.
* **Tenants.** A session belongs to the credential that used it. Its key in
  the store and in every per-session table is ``<tenant>/<id>``, the tenant
  being a digest of the configured tenant header's value (``tenant_header``:
  set by a trusted proxy in front of the server), else of the request's API
  key when the server has keys; without either, every client is one tenant
  and the key is the id. The same id under another credential is another
  session, so no request reads or changes memories it does not own.
* **Policies.** A request may name only the policies the operator allows
  (``Settings.client_policies``), and a session keeps the policy of its
  first request unless ``policy_switch`` is on.
* **Session ids** are 1-256 characters of UTF-8 text without control
  characters; a header's bytes are read as UTF-8 (Starlette reads them as
  Latin-1), so an id names the same session in the header and in the body.
"""

from __future__ import annotations

import hashlib
import unicodedata
from collections.abc import Callable, Mapping
from typing import Any

from vllm_pamer.settings import Settings

TENANT_CHARS = 16
"""Hex digits of the tenant digest in a session key."""
MAX_SESSION_ID_CHARS = 256
UNAUTHORIZED = {"error": "Unauthorized"}
"""vLLM's own answer to a request without a valid key (``AuthenticationMiddleware``)."""


class BadSessionId(ValueError):
    """A session id the plugin refuses (HTTP 400)."""


class Unauthorized(Exception):
    """A request to a plugin route without a valid API key (HTTP 401)."""


class PolicyRefused(Exception):
    """A policy this request may not use: not allowed (403) or not the session's (409)."""

    def __init__(self, message: str, status: int) -> None:
        super().__init__(message)
        self.status = status


def header_text(raw: str) -> str:
    """A header value as the UTF-8 text the client sent (Starlette decodes header bytes as Latin-1)."""
    try:
        return raw.encode("latin-1").decode("utf-8")
    except UnicodeError:
        raise BadSessionId("the X-Session-ID header is not UTF-8 text") from None


def check_session_id(session_id: Any) -> str:
    """``session_id`` if the plugin accepts it, else BadSessionId."""
    if not isinstance(session_id, str):
        raise BadSessionId("session_id must be a string")
    if not 1 <= len(session_id) <= MAX_SESSION_ID_CHARS:
        raise BadSessionId(f"session_id must have 1 to {MAX_SESSION_ID_CHARS} characters, not {len(session_id)}")
    try:
        session_id.encode("utf-8")
    except UnicodeEncodeError:
        raise BadSessionId("session_id is not valid Unicode text (a lone surrogate)") from None
    if any(unicodedata.category(c) == "Cc" for c in session_id):
        raise BadSessionId("session_id must not contain control characters")
    return session_id


class Access:
    """The server's keys, tenant rule and policy rules, read once at start-up."""

    def __init__(self, keys: list[str], key_check: Callable[[Mapping[str, str]], bool], settings: Settings) -> None:
        self.has_keys = bool(keys)
        self._check = key_check
        self.tenant_header = settings.tenant_header.lower() if settings.tenant_header else None
        self.policies = settings.client_policies
        """The policies a request may name (None: any)."""
        self.policy_switch = settings.policy_switch

    def check_policy(self, name: str, session_policy: str | None) -> None:
        """Raise PolicyRefused unless a request may run ``name`` on a session
        whose earlier requests ran ``session_policy`` (None: a new session)."""
        if self.policies is not None and name not in self.policies:
            allowed = ", ".join(sorted(self.policies))
            raise PolicyRefused(
                f"policy {name!r} is not allowed on this server (allowed: {allowed}; "
                "the operator allows more with --pamer-allowed-policies)",
                403,
            )
        if session_policy is not None and session_policy != name and not self.policy_switch:
            raise PolicyRefused(
                f"this session runs policy {session_policy!r}, not {name!r}; a session keeps its policy "
                "(the operator allows a change with --pamer-policy-switch)",
                409,
            )

    def authorize(self, headers: Mapping[str, str]) -> None:
        """Raise Unauthorized unless the server has no keys or ``headers`` carry one."""
        if self.has_keys and not self._check(headers):
            raise Unauthorized

    def tenant(self, headers: Mapping[str, str]) -> str:
        """The tenant a request belongs to ("" when every client is one)."""
        if self.tenant_header:
            owner = headers.get(self.tenant_header)
            if not owner:
                raise BadSessionId(f"a session needs the {self.tenant_header} header on this server")
        elif self.has_keys:
            owner = headers.get("authorization", "").partition(" ")[2]
        else:
            return ""
        return hashlib.sha256(owner.encode("utf-8", "surrogatepass")).hexdigest()[:TENANT_CHARS]

    def session_key(self, headers: Mapping[str, str], session_id: str) -> str:
        """The key of the session ``session_id`` names for this request's tenant."""
        tenant = self.tenant(headers)
        return f"{tenant}/{session_id}" if tenant else session_id
