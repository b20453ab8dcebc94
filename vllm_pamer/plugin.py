"""vLLM plugin entry points (``pyproject.toml``).

* ``register`` - ``vllm.general_plugins``; runs in every vLLM process (API
  server, EngineCore, workers): fixes the capture channel address for the
  child processes to inherit and registers the capturing model classes
  through the adapter of the installed vLLM (which refuses one it does not
  know, loudly, at start-up).
* ``endpoint`` - ``vllm.endpoint_plugins``; the API-server routes.
"""

from __future__ import annotations

from typing import Any

PLUGIN_NAMES = "pamer,pamer_endpoint"
"""The value of VLLM_PLUGINS that enables both halves."""


def register() -> None:
    from vllm_pamer.adapters.worker import register as register_worker_side
    from vllm_pamer.channel import ensure_channel_address

    ensure_channel_address()
    register_worker_side()


def endpoint() -> Any:
    from vllm_pamer.server.app import PamerEndpointPlugin

    return PamerEndpointPlugin()
