"""Recall where the query is: the worker's memory rows (``worker/memory.py``)
searched at capture, merged by the API server with what the worker did not
hold (``core.recall.merge_recall``); the answer must equal a plain cosine
Top-K over the session's memories as the store has them now. On CUDA too
(scripts/gpu_check.sh)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.memories import DIM, memories
from vllm_pamer.core.recall import WorkerRecall, cosine_top_k, merge_recall
from vllm_pamer.core.store import Memory
from vllm_pamer.kernels import MAX_K
from vllm_pamer.worker.memory import WorkerMemory

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CUDA: scripts/gpu_check.sh


def rows(ms: list[Memory]) -> list[tuple[int, bytes]]:
    return [(m.id, m.embedding.astype("<f4").tobytes()) for m in ms]


def recall(worker: WorkerMemory, session: str, query: np.ndarray) -> WorkerRecall | None:
    return worker.recall([session], torch.from_numpy(query[None]).to(DEVICE))[0]


def ids(ms):
    return [m.id for m in ms]


@pytest.mark.parametrize("seed", range(5))
def test_worker_recall_merged_equals_a_plain_top_k(seed):
    worker = WorkerMemory(DIM, rows=64, device=DEVICE)
    held = memories("s", 20, seed)
    worker.sync("s", [], rows(held))
    query = np.random.default_rng(100 + seed).standard_normal(DIM).astype(np.float32)
    found = recall(worker, "s", query)
    assert found is not None and found.limit == MAX_K and len(found.ids) == MAX_K
    for k in (1, 3, MAX_K):
        assert ids(merge_recall(found, query, held, k)) == ids(cosine_top_k(query, held, k))
    # memories added since the capture: scored by the API server
    now = held + memories("s", 6, seed + 50, start=100)
    assert ids(merge_recall(found, query, now, 3)) == ids(cosine_top_k(query, now, 3))
    # a few ranked memories discarded since: still decided while k of them remain
    best = cosine_top_k(query, held, MAX_K)
    fewer = [m for m in held if m.id not in {best[0].id, best[1].id}]
    assert ids(merge_recall(found, query, fewer, 3)) == ids(cosine_top_k(query, fewer, 3))
    # too many of them gone: a memory the worker did not return could rank, so no answer
    gone = {m.id for m in best[: MAX_K - 2]}
    assert merge_recall(found, query, [m for m in held if m.id not in gone], 3) is None
    assert merge_recall(found, query, held, MAX_K + 1) is None  # above the worker's K


def test_sessions_never_see_each_others_rows():
    worker = WorkerMemory(DIM, rows=64, device=DEVICE)
    a, b = memories("a", 5, 1), memories("b", 5, 2, start=50)
    worker.sync("a", [], rows(a))
    worker.sync("b", [], rows(b))
    query = b[0].embedding  # b's own memory, searched for as a
    found = recall(worker, "a", query)
    assert set(found.ids) <= {m.id for m in a} and set(found.searched) == {m.id for m in a}
    assert recall(worker, "b", query).ids[0] == b[0].id
    worker.drop("a")
    assert recall(worker, "a", query) is None and recall(worker, "b", query) is not None


def test_sync_frees_discarded_rows_and_skips_other_widths():
    worker = WorkerMemory(DIM, rows=8, device=DEVICE)
    ms = memories("s", 6, 3)
    assert worker.sync("s", [], rows(ms)) == 6
    assert worker.sync("s", [], rows(ms[3:])) == 3  # three discarded: their rows freed
    assert len(worker.matrix) == 3
    wide = Memory(99, "s", "w", np.ones(DIM + 1, np.float32), "served-model-state", (), (), 0.0)
    assert worker.sync("s", [], rows(ms[3:] + [wide])) == 3
    assert 99 not in recall(worker, "s", ms[3].embedding).searched


def test_full_rows_make_room_from_the_least_recently_used_session():
    worker = WorkerMemory(DIM, rows=6, device=DEVICE)
    a, b, c = memories("a", 3, 4), memories("b", 3, 5, start=20), memories("c", 3, 6, start=40)
    worker.sync("a", [], rows(a))
    worker.sync("b", [], rows(b))
    recall(worker, "a", a[0].embedding)  # a used since b
    assert worker.sync("c", [], rows(c)) == 3  # b's rows freed for c
    assert recall(worker, "b", b[0].embedding) is None and recall(worker, "a", a[0].embedding) is not None
    # one session larger than the rows: what fits, the rest scored by the API server
    big = memories("d", 9, 7, start=60)
    assert worker.sync("d", [], rows(big)) == 6
    query = np.random.default_rng(9).standard_normal(DIM).astype(np.float32)
    found = recall(worker, "d", query)
    assert len(found.searched) == 6 and worker.matrix.capacity == 6  # allocated whole, never grown
    assert ids(merge_recall(found, query, big, 3)) == ids(cosine_top_k(query, big, 3))


def test_one_search_for_a_steps_rows():
    worker = WorkerMemory(DIM, rows=64, device=DEVICE)
    a, b = memories("a", 10, 5), memories("b", 10, 6, start=50)
    worker.sync("a", [], rows(a))
    worker.sync("b", [], rows(b))
    queries = np.random.default_rng(7).standard_normal((4, DIM)).astype(np.float32)
    found = worker.recall(["a", None, "b", "unknown"], torch.from_numpy(queries).to(DEVICE))
    assert found[1] is None and found[3] is None
    assert ids(merge_recall(found[0], queries[0], a, 3)) == ids(cosine_top_k(queries[0], a, 3))
    assert ids(merge_recall(found[2], queries[2], b, 3)) == ids(cosine_top_k(queries[2], b, 3))
