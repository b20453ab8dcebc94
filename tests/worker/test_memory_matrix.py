"""MemoryMatrix (vllm_pamer/worker/memory_matrix.py): rows normalised on
insert, doubling growth, row -> session mapping, free-row reuse, and its
search through kernels.cosine_topk, on CPU (and CUDA when present)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from tests.support.kernels.oracles import check_topk
from vllm_pamer.worker.memory_matrix import MemoryMatrix

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _embedding(g, dim):
    v = torch.randn(dim, generator=g)
    v[v == 0] = 0.5
    return v


@pytest.mark.parametrize("device", DEVICES)
def test_add_normalises_and_grows_by_doubling(device):
    g = torch.Generator().manual_seed(0)
    mm = MemoryMatrix(16, device=device, capacity=2)
    embeddings = [_embedding(g, 16) * (i + 1) for i in range(9)]
    rows = [mm.add(i % 3, e) for i, e in enumerate(embeddings)]
    assert rows == list(range(9))
    assert mm.capacity == 16 and mm.size == 9 and len(mm) == 9  # 2 -> 4 -> 8 -> 16
    assert mm.matrix.device.type == device
    torch.testing.assert_close(mm.matrix.cpu(), F.normalize(torch.stack(embeddings), dim=1))
    assert mm.row_sessions.tolist() == [i % 3 for i in range(9)]
    assert mm.rows(1) == [1, 4, 7] and mm.session_of(4) == 1


@pytest.mark.parametrize("device", DEVICES)
def test_remove_reuses_lowest_free_row_and_trims(device):
    g = torch.Generator().manual_seed(1)
    mm = MemoryMatrix(8, device=device, capacity=4)
    for i in range(6):
        mm.add(i % 2, _embedding(g, 8))
    mm.remove(3)
    mm.remove(1)
    assert mm.row_sessions.tolist() == [0, -1, 0, -1, 0, 1]
    assert (mm.matrix[1] == 0).all() and (mm.matrix[3] == 0).all()
    assert mm.add(7, _embedding(g, 8)) == 1
    assert mm.add(7, _embedding(g, 8)) == 3
    assert mm.add(7, _embedding(g, 8)) == 6
    assert mm.remove_session(7) == 3
    assert mm.size == 6  # row 6 trimmed off the end; rows 1 and 3 free inside
    assert mm.remove_session(1) == 1  # row 5: freed and trimmed; row 4 is live
    assert mm.size == 5 and mm.rows(1) == [] and mm.rows(0) == [0, 2, 4]
    assert mm.remove_session(0) == 3
    assert mm.size == 0 and len(mm) == 0
    assert mm.add(2, _embedding(g, 8)) == 0
    with pytest.raises(KeyError):
        mm.remove(3)
    with pytest.raises(ValueError):
        mm.add(-1, _embedding(g, 8))
    with pytest.raises(ValueError):
        mm.add(1, torch.randn(9))


def test_random_operations_keep_the_books():
    """Random adds/removes against a plain dict model of the matrix."""
    rnd = random.Random(0)
    g = torch.Generator().manual_seed(2)
    mm = MemoryMatrix(12, capacity=1)
    model: dict[int, tuple[int, torch.Tensor]] = {}
    for _ in range(400):
        op = rnd.random()
        if op < 0.6 or not model:
            session, e = rnd.randrange(6), _embedding(g, 12)
            row = mm.add(session, e)
            assert row not in model
            model[row] = (session, F.normalize(e, dim=0))
        elif op < 0.9:
            row = rnd.choice(sorted(model))
            mm.remove(row)
            del model[row]
        else:
            session = rnd.randrange(6)
            gone = [r for r, (s, _) in model.items() if s == session]
            assert mm.remove_session(session) == len(gone)
            for r in gone:
                del model[r]
        assert len(mm) == len(model)
        assert mm.size == (max(model) + 1 if model else 0)
        free = set(range(mm.size)) - set(model)
        assert mm.capacity >= mm.size
        sessions = mm.row_sessions.tolist()
        for row, (session, unit) in model.items():
            assert sessions[row] == session and mm.session_of(row) == session
            torch.testing.assert_close(mm.matrix[row], unit)
        for row in free:
            assert sessions[row] == -1 and (mm.matrix[row] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("device", DEVICES)
def test_topk_sees_only_own_session(device, dtype):
    g = torch.Generator().manual_seed(3)
    dim = 64
    mm = MemoryMatrix(dim, device=device, dtype=dtype, capacity=8)
    for i in range(300):
        mm.add([1, 2, 2, 3, 3, 3][i] if i < 6 else 4 + i % 5, _embedding(g, dim))
    mm.add(4, torch.zeros(dim))  # a zero memory never matches
    for row in mm.rows(5)[:20]:
        mm.remove(row)
    queries = torch.randn(8, dim, generator=g)
    query_sessions = [0, 1, 2, 3, 4, 5, 8, 4]
    indices, scores = mm.topk(queries, query_sessions, 8)
    assert indices.device.type == device
    problem = (queries, torch.tensor(query_sessions), mm.matrix.cpu(), mm.row_sessions.cpu())
    check_topk((indices.cpu(), scores.cpu()), *problem, 8, tol=1e-5 if dtype == torch.float32 else 1e-3)
    assert (indices[0] == -1).all()
    assert [(indices[i] >= 0).sum().item() for i in (1, 2, 3)] == [1, 2, 3]
    # a single query as a vector, and an empty matrix
    assert mm.topk(queries[1], [1], 1)[0].tolist() == [[0]]
    empty = MemoryMatrix(dim, device=device)
    indices, scores = empty.topk(queries, query_sessions, 3)
    assert (indices == -1).all() and torch.isneginf(scores).all()
