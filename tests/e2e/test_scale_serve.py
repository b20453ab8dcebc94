"""vLLM's ways to scale, end to end: several API-server processes, data and
tensor parallel engines (a tiny random Llama), and replicas behind vLLM's
router sharing a PostgreSQL store, one of which dies mid-trajectory (a chat
session, and a Responses conversation the plugin holds). The
scenarios: ``tests/support/scale.py`` (``benchmarks/scale.py`` prints their figures)."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.fakes import blocking
from tests.support.scale import SMALL_KV, min_cosine, run_failover, run_mode, user_turns
from tests.support.serve import (
    HELD_BODY,
    assert_whole_conversation,
    chat,
    client_for,
    start_pamer_server,
    third_held_turn,
    two_held_turns,
)
from tests.support.tiny_models import build_tiny_model
from vllm_pamer.server_process import RouterProcess, free_port
from vllm_pamer.stores import open_store
from vllm_pamer.trajectories import agent_requests, load_trajectories

pytestmark = pytest.mark.e2e

SESSIONS = 4
STEPS = 8  # per session; each request on a connection of its own


@pytest.fixture(scope="module")
def trajectories():
    return load_trajectories(kind="tau")[:SESSIONS]


def _fresh_chat(server, history, session):
    """One request on a new connection (vLLM spreads connections over its API processes)."""
    client = client_for(server)
    try:
        return chat(client, history, session).model_extra["pamer"]
    finally:
        client.close()


def test_two_api_server_processes_capture_every_request_and_share_sessions(compress_heads, trajectories, tmp_path):
    """``--api-server-count 2``: every request's capture reaches the process
    that served it, both processes serve, and a session's vote reaches its next
    request whichever process takes it (no ``probe_missing``)."""
    store_path = tmp_path / "memory.sqlite3"
    server = start_pamer_server(compress_heads, store_path, tmp_path / "server.log", ["--api-server-count", "2"])
    try:
        steps = [list(agent_requests(t["messages"]))[:STEPS] for t in trajectories]

        def replay(index):
            return [_fresh_chat(server, history, f"multi-{index}") for _, history in steps[index]]

        with ThreadPoolExecutor(SESSIONS) as pool:  # concurrent sessions load both processes
            reports = [r for session in pool.map(replay, range(SESSIONS)) for r in session]
    finally:
        server.stop()
    assert all(r["captured"] for r in reports), [r["detail"] for r in reports if not r["captured"]]
    assert len({r["api_process"] for r in reports}) == 2
    assert not [r for r in reports if r["action"].startswith("fallback")]
    store = open_store(store_path)
    for index in range(SESSIONS):
        kinds = [e["kind"] for e in blocking(store).events(f"multi-{index}", limit=10_000)]
        assert "probe_missing" not in kinds, kinds


@pytest.mark.parametrize("mode", ["dp2", "tp2"])
def test_data_and_tensor_parallel_capture_each_request_once(mode, tokenizer_dir, tmp_path):
    """Two engine cores, or two tensor-parallel ranks: each request has exactly
    one capture, it reaches the serving API process, and the captured state is
    the single-process one."""
    model_dir = build_tiny_model("llama", tmp_path / "tiny-llama", tokenizer_dir)
    prompts = user_turns(8)
    single = run_mode("single", model_dir, prompts, tmp_path)
    result = run_mode(mode, model_dir, prompts, tmp_path)
    for run in (single, result):
        assert run.answered == run.captured == run.records == len(prompts), run
    assert len(result.states) == len(prompts)
    assert min_cosine(result, single) >= 0.999


def test_a_session_survives_the_loss_of_its_replica(compress_heads, pg_cluster, trajectories, tmp_path):
    """Two replicas behind vLLM's router (consistent hashing on
    ``X-Session-ID``) share a PostgreSQL store. Mid-trajectory the session's
    replica is killed; the router moves the session, which goes on with its
    memories: every request answered, none lost or written twice, recall on
    the new replica."""
    result = run_failover(compress_heads, pg_cluster.new_database(), trajectories[0], 14, tmp_path)
    assert result.memories_before and result.requests_after > 0
    assert result.answered_after == result.requests_after and result.fallbacks_after == 0
    assert len(result.served_before) == 1 and result.served_before == [result.killed]
    assert len(result.served_after) == 1 and result.served_after != result.served_before
    assert result.lost == 0 and result.blocks_archived_twice == 0 and result.raw_blocks_missing == 0
    assert result.recalled_after > 0, "recall works on the new replica"


def test_a_held_conversation_survives_the_loss_of_its_replica(compress_heads, pg_cluster, tmp_path):
    """Two replicas behind vLLM's router share a PostgreSQL store. Two turns
    of a Responses conversation (a function call and its output in the
    first) go through the router to the session's replica, which is then
    killed; the third turn continues from the second answer on the other
    replica with every earlier item, and the held answer is read back there."""
    import httpx
    import openai

    store_url = pg_cluster.new_database()
    replicas = [
        start_pamer_server(compress_heads, store_url, tmp_path / f"replica-{i}.log", SMALL_KV, port=free_port())
        for i in range(2)
    ]
    router = RouterProcess([r.base_url for r in replicas], tmp_path / "router.log")
    try:
        router.wait_ready()
        client = openai.OpenAI(base_url=f"{router.base_url}/v1", api_key="unused", max_retries=0, timeout=300)
        first, second = two_held_turns(client, HELD_BODY)  # the router hashes the header, forwards the body
        served = {first.model_extra["pamer"]["api_process"], second.model_extra["pamer"]["api_process"]}
        [killed] = [r for r in replicas if r.proc.pid in served]
        killed.kill()
        deadline = time.monotonic() + 180
        while True:  # the agent's retry: the router moves the session within seconds
            try:
                third = third_held_turn(client, second, extra_body=HELD_BODY)
                break
            except openai.APIError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(2)
        held = httpx.get(f"{router.base_url}/v1/responses/{second.id}", timeout=60)
    finally:
        router.stop()
        for replica in replicas:
            replica.stop()
    assert len(served) == 1 and third.model_extra["pamer"]["api_process"] not in served
    assert_whole_conversation(third)
    assert held.status_code == 200 and held.json()["id"] == second.id
