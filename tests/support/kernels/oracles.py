"""Float64 oracles for the kernel tests, written in numpy independently of the
kernels package, the random problems the tests share, and the comparison
rules with their tolerances.

Tolerances (against float64 on the same, already-quantised inputs, so only
accumulation error is measured):

* five_head_vote logits: |got - want| <= 2e-4 + 2e-4 |want| (fp32 sums over
  d <= 8192); votes exact for every row whose five logits are all more than
  1e-3 from their thresholds; decision == (votes >= min_votes) exactly.
* cosine_topk scores: |got - want| <= 1e-5 (cosines, fp32 sums over e <= 4096);
  the Top-K set must equal the oracle's whenever the k-th and (k+1)-th oracle
  scores differ by more than 1e-5, each rank must hold the oracle's row when it
  is that far from both neighbours, and every returned row must score within
  1e-5 of the k-th best.
"""

from __future__ import annotations

import math

import numpy as np
import torch

NUM_HEADS = 5
WIDTH = 256
VOTE_ATOL = 2e-4
VOTE_RTOL = 2e-4
VOTE_CLEAR = 1e-3
TOPK_TOL = 1e-5

_erf = np.vectorize(math.erf, otypes=[np.float64])


def f64(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().double().numpy()


# -- five_head_vote --------------------------------------------------------------


def vote_oracle(x, w1, b1, w2, b2) -> np.ndarray:
    """Logits [B, H] in float64: GELU(x @ w1[h] + b1[h]) @ w2[h] + b2[h]."""
    x64, w164, b164, w264, b264 = map(f64, (x, w1, b1, w2, b2))
    out = np.empty((x64.shape[0], w164.shape[0]))
    for h in range(w164.shape[0]):
        z = x64 @ w164[h] + b164[h]
        g = 0.5 * z * (1.0 + _erf(z / math.sqrt(2.0)))
        out[:, h] = g @ w264[h] + b264[h]
    return out


def vote_problem(batch: int, d: int, x_dtype=torch.float32, w_dtype=torch.float32, seed: int = 0):
    """Fresh random heads and rows (no zeros), and thresholds spread over the
    logits so the votes take several values. Returns (args, logits64) with
    args = [x, w1, b1, w2, b2, thresholds]."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, d, generator=g)
    x[x == 0] = 0.5
    w1 = torch.randn(NUM_HEADS, d, WIDTH, generator=g) / math.sqrt(d)
    b1 = 0.1 * torch.randn(NUM_HEADS, WIDTH, generator=g)
    w2 = torch.randn(NUM_HEADS, WIDTH, generator=g) / math.sqrt(WIDTH)
    b2 = 0.1 * torch.randn(NUM_HEADS, generator=g)
    x = x.to(x_dtype)
    w1, b1, w2, b2 = (t.to(w_dtype) for t in (w1, b1, w2, b2))
    logits64 = vote_oracle(x, w1, b1, w2, b2)
    spread = logits64.std() if logits64.size > 1 else 0.1
    thr = logits64.mean(axis=0) + 0.6 * spread * torch.randn(NUM_HEADS, generator=g).double().numpy()
    thresholds = torch.from_numpy(thr).float()
    return [x, w1, b1, w2, b2, thresholds], logits64


def check_vote(got, logits64: np.ndarray, thresholds: torch.Tensor, min_votes: int) -> int:
    """Asserts the comparison rules; returns how many rows had exact votes checked."""
    logits, votes, decision = got
    B = logits64.shape[0]
    assert logits.shape == (B, NUM_HEADS) and logits.dtype == torch.float32
    assert votes.shape == (B,) and votes.dtype == torch.int32
    assert decision.shape == (B,) and decision.dtype == torch.bool
    np.testing.assert_allclose(logits.cpu().numpy(), logits64, atol=VOTE_ATOL, rtol=VOTE_RTOL)
    thr64 = f64(thresholds)
    clear = (np.abs(logits64 - thr64) > VOTE_CLEAR).all(axis=1)
    want_votes = (logits64 > thr64).sum(axis=1)
    np.testing.assert_array_equal(votes.cpu().numpy()[clear], want_votes[clear])
    # the decision follows the oracle's votes where they are clear, and the kernel's own everywhere
    np.testing.assert_array_equal(decision.cpu().numpy()[clear], (want_votes >= min_votes)[clear])
    np.testing.assert_array_equal(decision.cpu().numpy(), votes.cpu().numpy() >= min_votes)
    return int(clear.sum())


def poisoned_vote_outputs(batch: int, want_decision: np.ndarray | None = None):
    """Outputs full of garbage a kernel that skips a write cannot pass with;
    the decision is poisoned with the opposite of the expected one."""
    logits = torch.full((batch, NUM_HEADS), float("nan"))
    votes = torch.full((batch,), -123, dtype=torch.int32)
    decision = torch.ones(batch, dtype=torch.bool)
    if want_decision is not None:
        decision = torch.from_numpy(~want_decision)
    return logits, votes, decision


# -- cosine_topk -----------------------------------------------------------------


def topk_oracle_scores(queries, query_sessions, matrix, row_sessions) -> np.ndarray:
    """Cosine scores [B, N] in float64, -inf where a row may not match."""
    q, m = f64(queries), f64(matrix)
    qs, rs = query_sessions.cpu().numpy(), row_sessions.cpu().numpy()
    qn, mn = np.linalg.norm(q, axis=1), np.linalg.norm(m, axis=1)
    with np.errstate(divide="ignore", invalid="ignore"):
        s = (q @ m.T) / qn[:, None] / mn[None, :]
    ok = (qs[:, None] == rs[None, :]) & (rs >= 0)[None, :] & (qn > 0)[:, None] & (mn > 0)[None, :]
    return np.where(ok, s, -np.inf)


def check_topk(got, queries, query_sessions, matrix, row_sessions, k: int, tol: float = TOPK_TOL) -> int:
    """Asserts the comparison rules; returns how many (query, rank) positions
    were compared exactly against the oracle's row."""
    indices, scores = got
    B, N = queries.shape[0], matrix.shape[0]
    assert indices.shape == (B, k) and indices.dtype == torch.int64
    assert scores.shape == (B, k) and scores.dtype in (torch.float32, torch.float64)
    idx, sc = indices.cpu().numpy(), scores.cpu().double().numpy()
    S = topk_oracle_scores(queries, query_sessions, matrix, row_sessions)
    exact = 0
    for b in range(B):
        order = np.lexsort((np.arange(N), -S[b]))  # score desc, then row asc
        ranked = S[b, order]
        valid = int(np.isfinite(S[b]).sum())
        n = min(k, valid)
        assert (idx[b, n:] == -1).all(), (b, idx[b], valid)
        assert np.isneginf(sc[b, n:]).all(), (b, sc[b])
        g = idx[b, :n]
        assert (g >= 0).all() and len(set(g.tolist())) == n, (b, g)
        assert np.isfinite(S[b, g]).all(), f"query {b} got rows it may not see: {g}"
        np.testing.assert_allclose(sc[b, :n], S[b, g], atol=tol, rtol=0)
        assert (np.diff(sc[b, :n]) <= 0).all(), (b, sc[b])
        if n == 0:
            continue
        assert (S[b, g] >= ranked[n - 1] - tol).all(), (b, g, order[:n])
        if n == valid or ranked[n - 1] - ranked[n] > tol:
            assert set(g.tolist()) == set(order[:n].tolist()), (b, g, order[:n])
        for j in range(n):
            above = j == 0 or ranked[j - 1] - ranked[j] > tol
            below = j + 1 >= valid or ranked[j] - ranked[j + 1] > tol
            if above and below:
                assert g[j] == order[j], (b, j, g, order[:n])
                exact += 1
    return exact


def topk_problem(batch: int, n: int, e: int, dtype=torch.float32, seed: int = 0):
    """Rows of sessions with 0 (session 0), 1, 2, 3 and many rows (4), a
    session whose only row is zero (6), a dozen small sessions, ~10% free rows
    and two zero rows in session 4, positions shuffled. Queries cycle through
    the sessions; with batch >= 7 one query is zero and one has session -1.
    Returns (queries, query_sessions, matrix, row_sessions)."""
    g = torch.Generator().manual_seed(seed)
    assert n >= 40
    sessions = [1] + [2] * 2 + [3] * 3 + [6]
    free = n // 10
    small = (n - len(sessions) - free) // 3
    sessions += [7 + i % 12 for i in range(small)]
    sessions += [-1] * free
    sessions += [4] * (n - len(sessions))
    perm = torch.randperm(n, generator=g)
    row_sessions = torch.tensor(sessions, dtype=torch.int64)[perm]
    matrix = torch.randn(n, e, generator=g)
    matrix[matrix == 0] = 0.5
    zero_rows = [int(i) for i in (row_sessions == 4).nonzero()[:2, 0]] + [int((row_sessions == 6).nonzero()[0, 0])]
    matrix[zero_rows] = 0.0
    cycle = [4, 1, 2, 3, 0, 6, 4, 7, 8, 4, 3, 2]
    query_sessions = torch.tensor([cycle[i % len(cycle)] for i in range(batch)], dtype=torch.int64)
    queries = torch.randn(batch, e, generator=g)
    queries[queries == 0] = 0.5
    if batch >= 7:
        queries[6] = 0.0  # session 4, zero query: no match
        query_sessions[5] = -1  # no session: no match
    return queries.to(dtype), query_sessions, matrix.to(dtype), row_sessions


def tie_problem(batch: int = 5, n: int = 300, e: int = 64, seed: int = 0):
    """Small-integer vectors with many exact duplicates: every dot product and
    norm is exact in fp32, so equal scores are equal bit for bit everywhere and
    the order among them must be by row number."""
    g = torch.Generator().manual_seed(seed)
    while True:
        base = torch.randint(-2, 3, (12, e), generator=g).float()
        base[base.abs().sum(dim=1) == 0, 0] = 1.0
        # distinct base vectors must give clearly distinct cosines, so the only
        # ties are the duplicates (not equal-in-theory, rounded-apart values)
        b64 = f64(base)
        unit = b64 / np.linalg.norm(b64, axis=1, keepdims=True)
        cos = unit @ unit.T
        gaps = np.abs(cos[:, :, None] - cos[:, None, :]) + 10 * np.eye(12)[None]
        if gaps.min() > 1e-6:
            break
    matrix = base[torch.randint(0, 12, (n,), generator=g)]
    row_sessions = torch.randint(0, 3, (n,), generator=g)
    queries = base[torch.randint(0, 12, (batch,), generator=g)]
    query_sessions = torch.arange(batch, dtype=torch.int64) % 3
    return queries, query_sessions, matrix, row_sessions


def topk_exact_oracle(queries, query_sessions, matrix, row_sessions, k: int):
    """Indices [B, k] by (score desc, row asc) in float64, -1 padded: for the
    tie problems, where the kernels must reproduce it exactly."""
    S = topk_oracle_scores(queries, query_sessions, matrix, row_sessions)
    out = np.full((S.shape[0], k), -1, dtype=np.int64)
    for b in range(S.shape[0]):
        order = np.lexsort((np.arange(S.shape[1]), -S[b]))
        order = order[np.isfinite(S[b, order])][:k]
        out[b, : len(order)] = order
    return out


def poisoned_topk_outputs(batch: int, k: int):
    return torch.full((batch, k), -7, dtype=torch.int64), torch.full((batch, k), float("nan"))
