"""The heads file: five MLP heads (d -> 256 -> 1, GELU) with per-head thresholds.

Stored as safetensors so it is small, safe to load and readable anywhere:

==============  ============  ==============================================
tensor          shape         meaning
==============  ============  ==============================================
``w1``          [5, d, 256]   first layer weights (x @ w1[h])
``b1``          [5, 256]      first layer bias
``w2``          [5, 256]      second layer weights
``b2``          [5]           second layer bias
``thresholds``  [5]           per-head decision threshold, in logit space
==============  ============  ==============================================

Metadata (strings): ``format``, ``min_votes`` and the model fingerprint
(``architecture``, ``hidden_size``, ``num_hidden_layers``, ``vocab_size``,
``model_name``) plus ``trained`` (``"true"`` only for heads fitted on labels).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

HEADS_FORMAT = "vllm-pamer-heads/1"
NUM_HEADS = 5
HIDDEN_WIDTH = 256


class HeadsMismatch(ValueError):
    """The heads file was made for another model."""


class ModelFingerprint(msgspec.Struct, frozen=True):
    """What must match between a heads file and the served model."""

    architecture: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    model_name: str = ""
    """Informative only: paths differ between machines, the shape does not."""

    @classmethod
    def from_hf_config(cls, config: Any, model_name: str = "") -> ModelFingerprint:
        text_config = getattr(config, "get_text_config", lambda: config)()
        architectures = getattr(config, "architectures", None) or ["unknown"]
        return cls(
            architecture=architectures[0],
            hidden_size=int(text_config.hidden_size),
            num_hidden_layers=int(text_config.num_hidden_layers),
            vocab_size=int(text_config.vocab_size),
            model_name=model_name,
        )

    def mismatch(self, other: ModelFingerprint) -> str | None:
        for field in ("architecture", "hidden_size", "num_hidden_layers", "vocab_size"):
            mine, theirs = getattr(self, field), getattr(other, field)
            if mine != theirs:
                return f"{field}: heads file has {mine!r}, served model has {theirs!r}"
        return None


class Heads(msgspec.Struct):
    """Five MLP heads as numpy arrays (float32), ready to move to torch."""

    w1: np.ndarray
    b1: np.ndarray
    w2: np.ndarray
    b2: np.ndarray
    thresholds: np.ndarray
    fingerprint: ModelFingerprint
    min_votes: int = 3
    trained: bool = False

    @property
    def hidden_size(self) -> int:
        return int(self.w1.shape[1])

    def check_model(self, served: ModelFingerprint, path: str | Path = "") -> None:
        problem = self.fingerprint.mismatch(served)
        if problem:
            raise HeadsMismatch(
                f"heads file {path or '(in memory)'} was made for model "
                f"{self.fingerprint.model_name or self.fingerprint.architecture!r}, "
                f"not the served model {served.model_name!r} ({problem}). "
                "Train heads for this model (vllm-pamer train) or pass --pamer-heads."
            )


def save_heads(heads: Heads, path: str | Path) -> None:
    from safetensors.numpy import save_file

    fp = heads.fingerprint
    metadata = {
        "format": HEADS_FORMAT,
        "min_votes": str(heads.min_votes),
        "trained": "true" if heads.trained else "false",
        "architecture": fp.architecture,
        "hidden_size": str(fp.hidden_size),
        "num_hidden_layers": str(fp.num_hidden_layers),
        "vocab_size": str(fp.vocab_size),
        "model_name": fp.model_name,
    }
    tensors = {
        name: np.ascontiguousarray(getattr(heads, name), dtype=np.float32)
        for name in ("w1", "b1", "w2", "b2", "thresholds")
    }
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)


def load_heads(path: str | Path) -> Heads:
    """Load and validate a heads file; raise ValueError with a clear reason."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"heads file not found: {path}")
    try:
        with safe_open(str(path), framework="numpy") as handle:
            metadata = handle.metadata() or {}
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118 - safe_open is not iterable
    except Exception as exc:  # safetensors raises several error types
        raise ValueError(f"{path} is not a readable safetensors heads file: {exc}") from exc
    if metadata.get("format") != HEADS_FORMAT:
        raise ValueError(f"{path}: format {metadata.get('format')!r}, expected {HEADS_FORMAT!r}")
    missing = {"w1", "b1", "w2", "b2", "thresholds"} - tensors.keys()
    if missing:
        raise ValueError(f"{path}: missing tensors {sorted(missing)}")
    d = int(metadata.get("hidden_size", -1))
    expected = {
        "w1": (NUM_HEADS, d, HIDDEN_WIDTH),
        "b1": (NUM_HEADS, HIDDEN_WIDTH),
        "w2": (NUM_HEADS, HIDDEN_WIDTH),
        "b2": (NUM_HEADS,),
        "thresholds": (NUM_HEADS,),
    }
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != shape:
            raise ValueError(f"{path}: tensor {name} has shape {tuple(tensors[name].shape)}, expected {shape}")
    fingerprint = ModelFingerprint(
        architecture=metadata.get("architecture", ""),
        hidden_size=d,
        num_hidden_layers=int(metadata.get("num_hidden_layers", -1)),
        vocab_size=int(metadata.get("vocab_size", -1)),
        model_name=metadata.get("model_name", ""),
    )
    min_votes = int(metadata.get("min_votes", 3))
    if not 1 <= min_votes <= NUM_HEADS:
        raise ValueError(f"{path}: min_votes {min_votes} is not in 1..{NUM_HEADS}")
    return Heads(
        **{name: tensors[name].astype(np.float32) for name in expected},
        fingerprint=fingerprint,
        min_votes=min_votes,
        trained=metadata.get("trained") == "true",
    )


def random_heads(fingerprint: ModelFingerprint, seed: int = 0) -> Heads:
    """Untrained heads with Kaiming-style random weights: for tests and demos
    until trained heads exist. Thresholds are 0 (probability 0.5)."""
    rng = np.random.default_rng(seed)
    d = fingerprint.hidden_size
    return Heads(
        w1=(rng.standard_normal((NUM_HEADS, d, HIDDEN_WIDTH)) / math.sqrt(d)).astype(np.float32),
        b1=(0.1 * rng.standard_normal((NUM_HEADS, HIDDEN_WIDTH))).astype(np.float32),
        w2=(rng.standard_normal((NUM_HEADS, HIDDEN_WIDTH)) / math.sqrt(HIDDEN_WIDTH)).astype(np.float32),
        b2=(0.1 * rng.standard_normal(NUM_HEADS)).astype(np.float32),
        thresholds=np.zeros(NUM_HEADS, dtype=np.float32),
        fingerprint=fingerprint,
        trained=False,
    )


def constant_heads(fingerprint: ModelFingerprint, logit: float) -> Heads:
    """Heads whose logits are ``logit`` whatever the state (w2 = 0, b2 = logit):
    a positive value forces the compress vote, a negative one forbids it. For
    tests and controlled experiments."""
    heads = random_heads(fingerprint, seed=0)
    heads.w2 = np.zeros_like(heads.w2)
    heads.b2 = np.full(NUM_HEADS, logit, dtype=np.float32)
    return heads
