"""Synthetic training data shared by the training tests: separable states with
metadata, layer states with a known answer, and directories of them written
through the states writer (``vllm_pamer.training.data``), manifest included."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vllm_pamer.training.data import FORMAT, open_run, write_shard


def synthetic_states(d=16, n_tau=16, trials=2, n_swe=24, seed=0):
    """Separable synthetic states: the label is a thresholded latent that the full
    state carries strongly and the Recent2 state weakly; metadata is noise."""
    rng = np.random.default_rng(seed)
    direction = rng.standard_normal(d)
    direction /= np.linalg.norm(direction)
    ids = [f"airline-task{t}-trial{k}" for t in range(n_tau) for k in range(trials)]
    ids += [f"django__django-{1000 + i}" for i in range(n_swe)]
    full, recent2, meta = [], [], []
    for tid in ids:
        for step in range(int(rng.integers(8, 20))):
            latent = rng.standard_normal()
            label = int(latent > 0.4)
            full.append(rng.standard_normal(d) + 4.0 * latent * direction)
            recent2.append(rng.standard_normal(d) + 2.0 * latent * direction)
            meta.append(
                {
                    "trajectory_id": tid,
                    "source": "tau" if tid.startswith("airline") else "swe",
                    "step": step,
                    "message_index": 2 * step + 2,
                    "full_tokens": int(rng.integers(1000, 9000)),
                    "recent2_tokens": int(rng.integers(200, 900)),
                    "truncated": False,
                    "turn": 1,
                    "last_tool": ["bash", "search", None][int(rng.integers(0, 3))],
                    "recall": int(rng.random() < 0.3),
                    "compression": label if step >= 1 else None,
                }
            )
    return np.asarray(full, np.float32), np.asarray(recent2, np.float32), meta


def layer_states(d=16, seed=0):
    full, _, meta = synthetic_states(d=d, seed=seed)
    rng = np.random.default_rng(seed + 1)
    n = len(meta)
    signal = full - rng.standard_normal(full.shape).astype(np.float32)  # ~ 4 * latent * direction
    last = np.stack([0.15 * signal + rng.standard_normal((n, d)), full], axis=1).astype(np.float32)
    mean = rng.standard_normal((n, 2, d)).astype(np.float32)
    return last, mean, ["block1", "norm"], full, meta


def write_states_dir(
    directory: Path, tensors: dict[str, np.ndarray], meta: list[dict], n_shards: int = 2, **manifest
) -> None:
    """``tensors`` (name -> [n, ...], rows as ``meta``) in ``n_shards`` shards
    with a manifest that plans them (``manifest`` adds keys, e.g. ``layers``)."""
    open_run(Path(directory), {"format": FORMAT, "shards": n_shards, **manifest})
    for k, rows in enumerate(np.array_split(np.arange(len(meta)), n_shards)):
        write_shard(Path(directory), k, {name: array[rows] for name, array in tensors.items()}, [meta[i] for i in rows])


def write_shards(directory: Path, full, recent2, meta, n_shards: int = 2) -> None:
    """An extraction directory of ``full`` / ``recent2`` states."""
    write_states_dir(directory, {"full": full, "recent2": recent2}, meta, n_shards)
