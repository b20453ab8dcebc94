"""The scaling scenarios (``tests/e2e/test_scale_serve.py`` checks them,
``benchmarks/scale.py`` prints their figures).

Capture per mode: a model served ``single``, ``api2`` (``--api-server-count
2``), ``dp2`` (``--data-parallel-size 2``) or ``tp2`` (``--tensor-parallel-size
2``; on two cores the parallel modes bind one core per rank), one prompt per
session, each on a new connection so vLLM spreads them over its API processes
(``run_mode``). Failover: two replicas of the default model with PaMER behind
vLLM's router share one store; once the session has a memory its replica is
killed and the rest goes through the router to the other one (``run_failover``).
"""

from __future__ import annotations

import asyncio
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np

from tests.support.serve import chat, client_for, start_pamer_server
from vllm_pamer.core.heads import constant_heads, save_heads
from vllm_pamer.default_model import DEFAULT_MODEL_NAME, ensure_default_model
from vllm_pamer.model_config import model_fingerprint
from vllm_pamer.server.sessions import SessionState
from vllm_pamer.server_process import RouterProcess, ServerProcess, free_port
from vllm_pamer.stores import open_store
from vllm_pamer.trajectories import agent_requests, load_trajectories

BIND_ONE_CORE_PER_RANK = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}
KV_SHARE_OF_RAM = "0.05"
"""``--gpu-memory-utilization`` of these servers (on CPU: the share of RAM each
engine reserves; serve's default 0.2 is 4.7 GiB a rank on a 24 GiB machine):
the tiny model needs little, and in the test suite the shared servers of
tests/e2e/conftest.py still hold theirs, so two ranks at 0.2 did not start
("Available memory on node 0 (4.51/23.59 GiB) ... is less than desired")."""
SMALL_KV = ("--gpu-memory-utilization", "0.1")
"""Less than serve's default for two replicas of the default model at once
(the failover); 0.05 leaves its weights too little KV cache for one 8,192-token request."""
MODES: dict[str, tuple[list[str], dict[str, str]]] = {
    "single": ([], {}),
    "api2": (["--api-server-count", "2"], {}),
    "dp2": (["--data-parallel-size", "2"], BIND_ONE_CORE_PER_RANK),
    "tp2": (["--tensor-parallel-size", "2"], BIND_ONE_CORE_PER_RANK),
}


class ModeResult(msgspec.Struct):
    mode: str
    requests: int
    answered: int
    captured: int
    """Responses that carried their own capture."""
    records: int
    """Capture records the API processes received (``vllm_pamer_capture_records``)."""
    api_processes: int
    states: dict[str, list[float]]
    """Each session's last captured state, from the store."""


def _post(base_url: str, model: str, session: str, content: str) -> dict[str, Any]:
    """One chat request on a connection of its own."""
    response = httpx.post(
        f"{base_url}/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0},
        headers={"X-Session-ID": session},
        timeout=300,
    )
    response.raise_for_status()
    return response.json()["pamer"]


def _records(base_url: str) -> int:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return int(sum(float(v) for v in re.findall(r"^vllm_pamer_capture_records_total(?:\{[^}]*\})? (\S+)$", text, re.M)))


def user_turns(count: int, chars: int = 1500) -> list[str]:
    """``count`` distinct user turns of the tau-bench trajectories."""
    turns: dict[str, None] = {}
    for trajectory in load_trajectories(kind="tau"):
        for message in trajectory["messages"]:
            if message["role"] == "user" and message.get("content"):
                turns.setdefault(str(message["content"])[:chars])
    if len(turns) < count:
        raise SystemExit(f"the tau-bench trajectories hold fewer than {count} distinct user turns")
    return list(turns)[:count]


def run_mode(mode: str, model_dir: Path, prompts: list[str], workdir: Path) -> ModeResult:
    """Serve ``model_dir`` in ``mode`` (policy none) and send each prompt as its own session."""
    args, env = MODES[mode]
    store_path = workdir / f"{mode}.sqlite3"
    server = ServerProcess(
        [str(model_dir), "--enforce-eager", "--max-model-len", "2048", "--gpu-memory-utilization", KV_SHARE_OF_RAM]
        + ["--pamer-policy", "none", *args],
        None,
        workdir / f"{mode}.log",
        env={"PAMER_STORE": str(store_path), **env},
    )
    try:
        server.wait_ready(timeout=600, progress=False)
        sessions = [f"{mode}-{i}" for i in range(len(prompts))]

        def send(i: int) -> dict[str, Any] | None:
            try:
                return _post(server.base_url, str(model_dir), sessions[i], prompts[i])
            except httpx.HTTPError:
                return None

        with ThreadPoolExecutor(4) as pool:
            reports = list(pool.map(send, range(len(prompts))))
        time.sleep(1)  # the last records reach the metrics
        try:
            records = _records(server.base_url)
        except httpx.HTTPError as exc:  # the server went away mid-run: say why, from its log
            raise RuntimeError(
                f"{mode}: the server stopped answering ({exc}); {sum(r is None for r in reports)} of "
                f"{len(reports)} requests failed; its first traceback:\n{server.first_traceback()}\n"
                f"its log ends:\n{server.tail(60)}"
            ) from exc
    finally:
        server.stop()
    store = open_store(store_path)
    states = {}
    for i, session in enumerate(sessions):
        stored = asyncio.run(store.session_state(session))
        if stored is not None:
            state = SessionState.decode(stored[0]).state()
            if state is not None:
                states[str(i)] = state.tolist()
    store.close()
    answered = [r for r in reports if r is not None]
    return ModeResult(
        mode=mode,
        requests=len(prompts),
        answered=len(answered),
        captured=sum(bool(r["captured"]) for r in answered),
        records=records,
        api_processes=len({r["api_process"] for r in answered}),
        states=states,
    )


def min_cosine(result: ModeResult, reference: ModeResult) -> float | None:
    """The smallest cosine between a session's state and the reference's (None: no pair)."""
    cosines = []
    for key, state in result.states.items():
        if key in reference.states:
            a, b = np.asarray(state), np.asarray(reference.states[key])
            cosines.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    return min(cosines) if cosines else None


class FailoverResult(msgspec.Struct):
    requests_before: int
    requests_after: int
    answered_after: int
    fallbacks_after: int
    memories_before: list[int]
    memories_after: list[int]
    lost: int
    """Memories of before missing after."""
    blocks_archived_twice: int
    raw_blocks_missing: int
    recalled_after: int
    """Requests after the failover that showed a recalled memory."""
    served_before: list[int]
    """API processes that served the session before the failover (one replica)."""
    served_after: list[int]
    killed: int
    """The killed replica's process."""


def compress_heads(path: Path) -> Path:
    """Heads that always vote to compress, for the default model."""
    fingerprint = model_fingerprint(ensure_default_model(quiet=True), DEFAULT_MODEL_NAME)
    save_heads(constant_heads(fingerprint, 10.0), path)
    return path


def _until_answered(server: Any, history: list[dict], session: str, timeout: float = 180.0) -> dict[str, Any]:
    """The agent's retry: a request that died with its replica is sent again."""
    deadline = time.monotonic() + timeout
    while True:
        client = client_for(server)
        try:
            return chat(client, history, session).model_extra["pamer"]
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)
        finally:
            client.close()


def run_failover(heads: Path, store_url: str, trajectory: dict, steps: int, workdir: Path) -> FailoverResult:
    session = "failover"
    history = [h for _, h in list(agent_requests(trajectory["messages"]))[:steps]]
    replicas: list[ServerProcess] = []
    router = None
    store = open_store(store_url)
    try:
        for i in range(2):
            log = workdir / f"replica-{i}.log"
            replicas.append(start_pamer_server(heads, store_url, log, SMALL_KV, port=free_port()))
        router = RouterProcess([r.base_url for r in replicas], workdir / "router.log")
        router.wait_ready()
        before: list[dict[str, Any]] = []
        while len(before) < len(history) and not asyncio.run(store.load(session)).memories:
            before.append(_until_answered(router, history[len(before)], session))
        memories_before = [m.id for m in asyncio.run(store.load(session)).memories]
        # one API process per replica: vllm-pamer serve runs vLLM's CLI in its own process
        [served] = [r for r in replicas if r.proc.pid == before[-1]["api_process"]]
        served.kill()
        after = []
        for messages in history[len(before) :]:
            try:
                after.append(_until_answered(router, messages, session))
            except Exception:
                break
    finally:
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.stop()
    memories = asyncio.run(store.load(session)).memories
    covered = [b for m in memories for b in m.covered_block_ids]
    raw = asyncio.run(store.raw_blocks(session, covered))
    store.close()
    return FailoverResult(
        requests_before=len(before),
        requests_after=len(history) - len(before),
        answered_after=len(after),
        fallbacks_after=sum(r["action"].startswith("fallback") for r in after),
        memories_before=memories_before,
        memories_after=[m.id for m in memories],
        lost=len(set(memories_before) - {m.id for m in memories}),
        blocks_archived_twice=len(covered) - len(set(covered)),
        raw_blocks_missing=len(set(covered) - set(raw)),
        recalled_after=sum(bool(r["recalled"]) for r in after),
        served_before=sorted({r["api_process"] for r in before}),
        served_after=sorted({r["api_process"] for r in after}),
        killed=served.proc.pid,
    )
