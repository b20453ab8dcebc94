"""The server a replay starts for itself (``vllm-pamer replay --serve``,
``benchmarks/policies.py``): no second terminal, and a server set up so that
policies compare: every policy selectable per request, the named variants
served (``replay/variants.py``), a fresh memory store, and an empty prefix
cache on request before each policy run."""

from __future__ import annotations

import json
import os
from pathlib import Path

from vllm_pamer.server_process import ServerProcess


def start_server(
    heads: str | Path,
    options: dict,
    serve_args: str,
    kv_cache_gib: float | None,
    log: Path,
    kv_cache_blocks: int | None = None,
) -> ServerProcess:
    """A ``vllm-pamer serve`` of the embedded model (not waited for): every
    policy selectable per request, ``options`` by policy name
    (``variants.policy_options``), a fresh memory store beside ``log``; the KV
    cache as vLLM sizes it, or ``kv_cache_gib``, or ``kv_cache_blocks`` blocks."""
    serve = [
        "--pamer-policy",
        "none",
        "--pamer-heads",
        str(heads),
        "--pamer-options-by-policy",
        json.dumps(options),
        "--pamer-allowed-policies",
        "*",
        *serve_args.split(),
    ]
    if kv_cache_gib is not None:
        serve += ["--kv-cache-memory-bytes", str(int(kv_cache_gib * 2**30))]
    if kv_cache_blocks is not None:  # the same tokens on any machine (bytes per token differ by dtype)
        serve += ["--num-gpu-blocks-override", str(kv_cache_blocks)]
    # dev mode serves POST /reset_prefix_cache: each run starts from an empty
    # prefix cache, so "prefill computed" compares across policies
    env = {"PAMER_STORE": str(log.parent / "memory.sqlite3"), "VLLM_SERVER_DEV_MODE": "1"}
    # vLLM's CPU engine keeps a core for its scheduler unless told not to:
    # on 2 cores, letting it use both runs this replay faster
    if "VLLM_CPU_NUM_OF_RESERVED_CPU" not in os.environ:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    return ServerProcess(serve, None, log, env=env)
