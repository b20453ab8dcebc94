"""End-to-end fixtures shared across modules: one server per configuration
for the whole session (an engine start costs tens of seconds here)."""

from __future__ import annotations

import pytest

from tests.support.serve import start_pamer_server
from vllm_pamer.core.heads import constant_heads, save_heads
from vllm_pamer.model_config import model_fingerprint


@pytest.fixture(scope="session")
def compress_heads(default_model_dir, tmp_path_factory):
    """Heads that always vote "compress": every gate-passing request compresses."""
    path = tmp_path_factory.mktemp("heads") / "always-compress.safetensors"
    fingerprint = model_fingerprint(default_model_dir, "SmolLM2-135M-Instruct")
    save_heads(constant_heads(fingerprint, 10.0), path)
    return path


@pytest.fixture(scope="session")
def compress_server(compress_heads, tmp_path_factory):
    """``vllm-pamer serve`` with always-compress heads; policies by request header."""
    root = tmp_path_factory.mktemp("compress-server")
    server = start_pamer_server(compress_heads, root / "memory.sqlite3", root / "server.log")
    yield server
    server.stop()
