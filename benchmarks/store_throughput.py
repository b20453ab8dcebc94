"""Memory store throughput: SQLite (embedded) beside PostgreSQL (shared by
replicas), with 1 and 4 concurrent writers, measured in one run.

    .venv/bin/python -m benchmarks.store_throughput
    .venv/bin/python -m benchmarks.store_throughput --commits 40 --rounds 3

Each writer is a store object of its own (its own connection, as a replica
has) in a thread of its own, on a session of its own. A commit stores one
memory with the raw blocks of two real agent steps (of the tau-bench and
mini-swe-agent trajectories) and its event; a recall load reads back every memory of the
session, as a request of a session with memories does (here the session holds every memory its
writer committed). PostgreSQL is a
throw-away cluster started here (``tests/support/postgres.py``) with durability off
(``fsync=off``), SQLite runs WAL with ``synchronous=NORMAL``: neither waits for
the disk, so the figures compare the engines' work, not the disk. Rounds
alternate the backends (a b b a ...) so a load on the machine falls on both.
Prints commits/s and loads/s per backend and writer count, and the ratio
PostgreSQL / SQLite.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tests.support.postgres import Cluster
from vllm_pamer.core.blocks import Block, split_conversation
from vllm_pamer.core.policies.summary_writer import step_details
from vllm_pamer.stores import open_store
from vllm_pamer.stores.sql import SqlStore
from vllm_pamer.trajectories import load_trajectories


def real_blocks(count: int) -> list[Block]:
    """``count`` distinct blocks of real agent steps (a block id is unique in a session)."""
    blocks: dict[str, Block] = {}
    for trajectory in [*load_trajectories(kind="tau"), *load_trajectories(kind="swe")]:
        for block in split_conversation(trajectory["messages"]).blocks:
            blocks.setdefault(block.block_id, block)
        if len(blocks) >= count:
            return list(blocks.values())[:count]
    raise SystemExit(f"the trajectories hold fewer than {count} distinct steps: ask for fewer --commits")


def store_at(location: str) -> SqlStore:
    store = open_store(location)
    assert isinstance(store, SqlStore)
    return store


def timed(writers: int, work: Callable[[int], int]) -> float:
    """Operations per second of ``writers`` threads released together."""
    barrier = threading.Barrier(writers + 1)
    done: list[int] = []

    def run(index: int) -> None:
        barrier.wait()
        done.append(work(index))

    with ThreadPoolExecutor(writers) as pool:
        futures = [pool.submit(run, i) for i in range(writers)]
        barrier.wait()
        start = time.perf_counter()
        for future in futures:
            future.result()
        elapsed = time.perf_counter() - start
    return sum(done) / elapsed


def measure(stores: Sequence[SqlStore], blocks: list[Block], commits: int, tag: str) -> tuple[float, float]:
    """(commits/s, loads/s) of ``len(stores)`` writers, each on its own session."""
    vector = np.random.default_rng(0).standard_normal(576).astype(np.float32)

    def commit(index: int) -> int:
        store, session = stores[index], f"{tag}-{index}"
        for i in range(commits):
            pair = blocks[2 * i : 2 * i + 2]
            store._commit_memory(session, f"summary {i}", vector, "bench", pair, step_details(pair))
            store._log_event(session, "compressed", {"step": i})
        return commits

    def load(index: int) -> int:
        store = stores[index]
        for _ in range(commits):
            store._load(f"{tag}-{index}")
        return commits

    return timed(len(stores), commit), timed(len(stores), load)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--commits", type=int, default=60, help="commits (and loads) per writer per round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of a b b a (each backend twice per round)")
    parser.add_argument("--writers", default="1,4", help="concurrent writers to measure")
    args = parser.parse_args(argv)
    blocks = real_blocks(2 * args.commits)
    writer_counts = [int(w) for w in args.writers.split(",")]
    results: dict[tuple[str, int], list[tuple[float, float]]] = {}
    with Cluster() as cluster, tempfile.TemporaryDirectory() as folder:
        locations = {"sqlite": str(Path(folder) / "memory.sqlite3"), "postgresql": cluster.new_database()}
        run = 0
        for _ in range(args.rounds):
            for backend in ("sqlite", "postgresql", "postgresql", "sqlite"):
                for writers in writer_counts:
                    stores = [store_at(locations[backend]) for _ in range(writers)]
                    try:
                        figures = measure(stores, blocks, args.commits, f"r{run}")
                    finally:
                        for store in stores:
                            store.close()
                    run += 1
                    results.setdefault((backend, writers), []).append(figures)
                    print(f"{backend:10} writers={writers}: {figures[0]:8.1f} commits/s {figures[1]:8.1f} loads/s")
    print()
    print("| writers | SQLite commits/s | PostgreSQL commits/s | ratio | SQLite loads/s | PostgreSQL loads/s | ratio |")
    print("|---|---|---|---|---|---|---|")
    for writers in writer_counts:
        sqlite = [statistics.median(x) for x in zip(*results[("sqlite", writers)])]
        pg = [statistics.median(x) for x in zip(*results[("postgresql", writers)])]
        print(
            f"| {writers} | {sqlite[0]:.0f} | {pg[0]:.0f} | {pg[0] / sqlite[0]:.2f} "
            f"| {sqlite[1]:.0f} | {pg[1]:.0f} | {pg[1] / sqlite[1]:.2f} |"
        )


if __name__ == "__main__":
    main()
