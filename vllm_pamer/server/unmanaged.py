"""Nothing silent: a request that names a session on a route the plugin does
not manage (completions, batch, and any other) goes through as vLLM serves
it, with a response header saying the memory was not applied and why, a
warning logged once per route, and ``vllm_pamer_unmanaged_requests_total``.

An ASGI middleware (it runs before vLLM's routes and adds a header to the
answer, streamed or not, without reading either body). A route that manages
only some bodies (``/invocations``: chat bodies) marks the requests it
managed (``mark_managed``); the middleware decides when the answer starts."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Iterable, MutableMapping
from typing import Any

from vllm_pamer.server import metrics

logger = logging.getLogger("vllm_pamer.server")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
ASGIApp = Callable[[Scope, Callable[[], Awaitable[Message]], Callable[[Message], Awaitable[None]]], Awaitable[None]]

NOTICE_HEADER = b"x-pamer-memory"
KNOWN_ROUTES = (
    "/v1/completions",
    "/v1/chat/completions/batch",
    "/v1/responses",
    "/invocations",
    "/v1/embeddings",
    "/tokenize",
    "/detokenize",
)
"""Routes named as themselves in the metric's label (any other: ``other``, so
the label's values stay few whatever clients send)."""


MANAGED_MARK = "pamer_managed"


def mark_managed(scope: Scope) -> None:
    """Marks a request the plugin managed on a route it does not always manage."""
    scope.setdefault("state", {})[MANAGED_MARK] = True


class UnmanagedSessionNotice:
    """Marks the answers of requests with a session id on unmanaged routes."""

    def __init__(
        self, app: ASGIApp, managed: Iterable[str], session_headers: Iterable[str] = ("x-session-id",)
    ) -> None:
        self.app = app
        self.managed = frozenset(managed)
        self.session_headers = frozenset(name.encode("latin-1") for name in session_headers)
        self.warned: set[str] = set()

    async def __call__(
        self, scope: Scope, receive: Callable[[], Awaitable[Message]], send: Callable[[Message], Awaitable[None]]
    ) -> None:
        path = scope.get("path", "")
        if scope.get("type") != "http" or path in self.managed or path.startswith("/pamer/"):
            await self.app(scope, receive, send)
            return
        if not any(name in self.session_headers and value for name, value in scope.get("headers") or ()):
            await self.app(scope, receive, send)
            return
        route = path if path in KNOWN_ROUTES else "other"
        notice = f"not applied: {path} is not a route vllm-pamer manages ({', '.join(sorted(self.managed))})"

        async def send_with_notice(message: Message) -> None:
            if message.get("type") == "http.response.start" and not (scope.get("state") or {}).get(MANAGED_MARK):
                self._count(route, path)
                message["headers"] = [*message.get("headers", []), (NOTICE_HEADER, notice.encode("latin-1", "replace"))]
            await send(message)

        await self.app(scope, receive, send_with_notice)

    def _count(self, route: str, path: str) -> None:
        metrics.UNMANAGED_REQUESTS.labels(route).inc()
        if route not in self.warned:
            self.warned.add(route)
            logger.warning(
                "a request to %s names a session, but vllm-pamer manages only %s: served without memory "
                "(logged once per route)",
                path,
                ", ".join(sorted(self.managed)),
            )
