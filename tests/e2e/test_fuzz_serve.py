"""Fuzzed requests to every managed route against a real ``vllm-pamer
serve`` (PaMER, an API key, a 2,048-token window): every answer is a 4xx in
an error format or a valid answer, never a 5xx, and the server stays up. ``PAMER_FUZZ_EXAMPLES`` sets
how many (the long run: ``benchmarks/adversarial.py``)."""

from __future__ import annotations

import os

import httpx
import pytest
from hypothesis import given

from tests.support.fuzz_requests import (
    FUZZ_SERVER_ARGS,
    KEY,
    ROUTES,
    check_answer,
    fuzz_settings,
    fuzzed_requests,
    send,
)
from vllm_pamer.demo import ensure_demo_heads
from vllm_pamer.server_process import ServerProcess

pytestmark = pytest.mark.e2e

EXAMPLES = int(os.environ.get("PAMER_FUZZ_EXAMPLES", "300"))


@pytest.fixture(scope="module")
def client(default_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    heads = ensure_demo_heads(default_model_dir)
    server = ServerProcess(
        [*FUZZ_SERVER_ARGS, "--pamer-heads", str(heads)],
        None,
        root / "server.log",
        env={"PAMER_STORE": str(root / "memory.sqlite3")},
    )
    try:
        server.wait_ready(timeout=600, progress=False)
        with httpx.Client(base_url=server.base_url, timeout=300) as http:
            yield http
    finally:
        server.stop()


@pytest.mark.parametrize("api", list(ROUTES))
def test_fuzzed_requests_get_a_4xx_or_an_answer_never_a_5xx(client, api):
    @fuzz_settings(EXAMPLES if api == "chat" else EXAMPLES // 3)
    @given(fuzzed_requests(KEY, api))
    def one(request):
        check_answer(send(client, request, api), api)

    one()
    assert client.get("/health").status_code == 200
