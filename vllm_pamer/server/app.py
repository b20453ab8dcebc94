"""The ``vllm.endpoint_plugins`` entry: the plugin's routes and its state on
``app.state.pamer``."""

from __future__ import annotations

import logging
from argparse import Namespace
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute

from vllm_pamer.server.access import UNAUTHORIZED, Unauthorized
from vllm_pamer.server.routes import DELEGATED, VLLM_ROUTES, open_router, router
from vllm_pamer.server.state import ServerState
from vllm_pamer.server.unmanaged import UnmanagedSessionNotice
from vllm_pamer.settings import Settings

logger = logging.getLogger("vllm_pamer.server")


async def _unauthorized(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(content=UNAUTHORIZED, status_code=401)


class PamerEndpointPlugin:
    name = "pamer_endpoint"
    required_tasks = ("generate",)

    def attach_router(self, app: FastAPI) -> None:
        # vLLM's own handlers of the routes the plugin's replace serve what those pass
        # on (vLLM then drops them: plugins/endpoint_plugins/interface.py)
        own = {
            (route.path, method): route.endpoint
            for route in app.routes
            if isinstance(route, APIRoute)
            for method in route.methods
            if (route.path, method) in DELEGATED
        }
        setattr(app.state, VLLM_ROUTES, own)
        app.include_router(router)
        app.include_router(open_router)
        app.add_exception_handler(Unauthorized, _unauthorized)
        managed = [route.path for route in router.routes if isinstance(route, APIRoute) and "{" not in route.path]
        headers = Settings.from_env().session_header_names
        app.add_middleware(UnmanagedSessionNotice, managed=managed, session_headers=headers)

    async def init_state(self, engine_client: Any, state: Any, args: Namespace) -> None:
        if engine_client is None:
            raise RuntimeError("vllm-pamer needs an engine (the render-only server is not supported)")
        server = ServerState(Settings.from_env(), engine_client, args)
        server.inbox.start()
        state.pamer = server
        logger.info(
            "vllm-pamer ready: policy=%s heads=%s channel=%s tools_as_text=%s",
            server.default_policy.name,
            server.settings.heads,
            server.inbox.address,
            server.tools_as_text,
        )
