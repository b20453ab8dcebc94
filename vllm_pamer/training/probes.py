"""The probe heads and how they are fitted and exported (PaMER paper §3, eqs. 4 and 25):
linear or MLP heads on final-norm states, class-weighted BCE (eq. 4), decision
distillation (eq. 25), the best-validation-epoch checkpoint, and the export
into the heads file the server loads (``vllm_pamer.core.heads``), with the
train-split standardization folded into the weights."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

HIDDEN_WIDTH = 256


@contextmanager
def torch_threads(threads: int | None) -> Iterator[None]:
    """Run a block with ``threads`` torch CPU threads (None: torch's setting),
    restoring the previous count afterwards."""
    previous = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def weighted_bce(z: torch.Tensor, y: torch.Tensor, rho: float) -> torch.Tensor:
    """Class-weighted BCE on logits (eq. 4 / 16), mean over rows:
    ``(rho y + 1 - y) softplus(z) - rho y z`` = ``-[rho y log p + (1-y) log(1-p)]``."""
    y = y.to(z.dtype)
    return ((rho * y + 1.0 - y) * F.softplus(z) - rho * y * z).mean()


def distillation_loss(
    z: torch.Tensor, y: torch.Tensor, q: torch.Tensor, rho: float, weight: float = 0.5
) -> torch.Tensor:
    """Decision distillation (eq. 25): ``WBCE(z, y) + weight * BCEWithLogits(z, q)``,
    ``q`` the teacher's probability on the same rows."""
    return weighted_bce(z, y, rho) + weight * F.binary_cross_entropy_with_logits(z, q.to(z.dtype))


class ProbeHead(torch.nn.Module):
    """``linear``: ``x . w + b``; ``mlp``: ``GELU(x @ w1 + b1) . w2 + b2``
    (exact-erf GELU, the layout of the heads file: w1 [d, W])."""

    def __init__(self, d: int, kind: str = "mlp", hidden: int = HIDDEN_WIDTH) -> None:
        super().__init__()
        if kind not in ("linear", "mlp"):
            raise ValueError(f"head kind must be linear or mlp, not {kind!r}")
        self.kind = kind
        bound = 1.0 / math.sqrt(d)  # torch.nn.Linear's default init
        if kind == "linear":
            self.w = torch.nn.Parameter(torch.empty(d).uniform_(-bound, bound))
            self.b = torch.nn.Parameter(torch.empty(()).uniform_(-bound, bound))
        else:
            self.w1 = torch.nn.Parameter(torch.empty(d, hidden).uniform_(-bound, bound))
            self.b1 = torch.nn.Parameter(torch.empty(hidden).uniform_(-bound, bound))
            bound2 = 1.0 / math.sqrt(hidden)
            self.w2 = torch.nn.Parameter(torch.empty(hidden).uniform_(-bound2, bound2))
            self.b2 = torch.nn.Parameter(torch.empty(()).uniform_(-bound2, bound2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "linear":
            return x @ self.w + self.b
        return F.gelu(x @ self.w1 + self.b1) @ self.w2 + self.b2


@dataclass
class Standardizer:
    """``(x - mean) / scale`` with train-split statistics (scale 1 for constant dims)."""

    mean: np.ndarray
    scale: np.ndarray

    @classmethod
    def fit(cls, x: np.ndarray) -> Standardizer:
        x64 = x.astype(np.float64)
        mean = x64.mean(axis=0)
        scale = x64.std(axis=0)
        scale = np.where(scale > 1e-6, scale, 1.0)
        return cls(mean=mean, scale=scale)

    @classmethod
    def identity(cls, d: int) -> Standardizer:
        return cls(mean=np.zeros(d), scale=np.ones(d))

    def __call__(self, x: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(((x - self.mean) / self.scale).astype(np.float32))


@dataclass
class FittedHead:
    head: ProbeHead
    standardizer: Standardizer
    best_epoch: int
    best_val_loss: float

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Logits on raw states (standardized here)."""
        with torch.no_grad():
            return self.head(self.standardizer(x)).double().numpy()


def fit_head(
    x_train: torch.Tensor,
    y_train: torch.Tensor,
    x_val: torch.Tensor,
    y_val: torch.Tensor,
    *,
    kind: str,
    rho: float,
    seed: int,
    teacher_train: torch.Tensor | None = None,
    distill_weight: float = 0.5,
    epochs: int = 50,
    lr: float = 1e-3,
    batch_size: int = 256,
    weight_decay: float = 0.01,
    hidden: int = HIDDEN_WIDTH,
) -> tuple[ProbeHead, int, float]:
    """Train one head on (already standardized) inputs; keep the epoch with the
    lowest validation label loss (WBCE, without the distillation term).
    Returns (head at its best epoch, best epoch (1-based), best val loss)."""
    torch.manual_seed(seed)
    head = ProbeHead(x_train.shape[1], kind, hidden)
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=weight_decay)
    generator = torch.Generator().manual_seed(seed)
    y_train = y_train.float()
    y_val = y_val.float()
    n = x_train.shape[0]
    best_loss, best_epoch = math.inf, 0
    best_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    for epoch in range(1, epochs + 1):
        head.train()
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            z = head(x_train[idx])
            if teacher_train is None:
                loss = weighted_bce(z, y_train[idx], rho)
            else:
                loss = distillation_loss(z, y_train[idx], teacher_train[idx], rho, distill_weight)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            val_loss = float(weighted_bce(head(x_val), y_val, rho)) if len(y_val) else float(loss)
        if val_loss < best_loss:
            best_loss, best_epoch = val_loss, epoch
            best_state = {k: v.detach().clone() for k, v in head.state_dict().items()}
    head.load_state_dict(best_state)
    head.eval()
    return head, best_epoch, best_loss


def export_head(fitted: FittedHead, hidden: int = HIDDEN_WIDTH) -> dict[str, np.ndarray]:
    """One head in the heads-file layout (w1 [d, W], b1 [W], w2 [W], b2 []),
    reading *raw* states: the standardization is folded into w1 / b1.

    A linear head becomes an exact MLP through ``GELU(a) - GELU(-a) = a``:
    hidden unit 0 computes ``a = w.x``, unit 1 ``-a``, ``w2 = (1, -1, 0, ...)``."""
    head, std = fitted.head, fitted.standardizer
    inv = 1.0 / std.scale
    shift = std.mean * inv  # x_std = x * inv - shift
    if head.kind == "mlp":
        w1 = head.w1.detach().double().numpy()
        b1 = head.b1.detach().double().numpy()
        w1_raw = w1 * inv[:, None]
        b1_raw = b1 - shift @ w1
        w2 = head.w2.detach().double().numpy()
        b2 = float(head.b2.detach())
    else:
        w = head.w.detach().double().numpy() * inv
        d = w.shape[0]
        w1_raw = np.zeros((d, hidden))
        w1_raw[:, 0], w1_raw[:, 1] = w, -w
        b1_raw = np.zeros(hidden)
        w2 = np.zeros(hidden)
        w2[0], w2[1] = 1.0, -1.0
        b2 = float(head.b.detach()) - float(shift @ (head.w.detach().double().numpy()))
    return {
        "w1": w1_raw.astype(np.float32),
        "b1": b1_raw.astype(np.float32),
        "w2": w2.astype(np.float32),
        "b2": np.float32(b2),
    }


def stack_heads(exported: Sequence[Mapping[str, Any]], thresholds: Sequence[float], fingerprint, min_votes: int = 3):
    """Five exported heads + logit thresholds -> ``vllm_pamer.core.heads.Heads``."""
    from vllm_pamer.core.heads import NUM_HEADS, Heads

    if len(exported) != NUM_HEADS:
        raise ValueError(f"the heads file holds {NUM_HEADS} heads, got {len(exported)} (one per seed)")
    return Heads(
        w1=np.stack([e["w1"] for e in exported]).astype(np.float32),
        b1=np.stack([e["b1"] for e in exported]).astype(np.float32),
        w2=np.stack([e["w2"] for e in exported]).astype(np.float32),
        b2=np.asarray([e["b2"] for e in exported], dtype=np.float32),
        thresholds=np.asarray(thresholds, dtype=np.float32),
        fingerprint=fingerprint,
        min_votes=min_votes,
        trained=True,
    )
