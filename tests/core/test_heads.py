"""The heads file format and the model fingerprint check (``core/heads.py``)."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from vllm_pamer.core.heads import (
    HEADS_FORMAT,
    HIDDEN_WIDTH,
    NUM_HEADS,
    Heads,
    HeadsMismatch,
    ModelFingerprint,
    load_heads,
    random_heads,
    save_heads,
)

TENSORS = ("w1", "b1", "w2", "b2", "thresholds")


FP = ModelFingerprint(
    architecture="LlamaForCausalLM", hidden_size=64, num_hidden_layers=4, vocab_size=1000, model_name="tiny/model"
)


def _heads(fingerprint: ModelFingerprint = FP, seed: int = 1, min_votes: int = 2, trained: bool = True) -> Heads:
    heads = random_heads(fingerprint, seed=seed)
    heads.thresholds = np.random.default_rng(seed + 100).standard_normal(NUM_HEADS).astype(np.float32)
    heads.min_votes = min_votes
    heads.trained = trained
    return heads


def _metadata(fingerprint: ModelFingerprint = FP, **overrides: str) -> dict[str, str]:
    metadata = {
        "format": HEADS_FORMAT,
        "min_votes": "3",
        "trained": "false",
        "architecture": fingerprint.architecture,
        "hidden_size": str(fingerprint.hidden_size),
        "num_hidden_layers": str(fingerprint.num_hidden_layers),
        "vocab_size": str(fingerprint.vocab_size),
        "model_name": fingerprint.model_name,
    }
    metadata.update(overrides)
    return metadata


def _tensors(heads: Heads) -> dict[str, np.ndarray]:
    return {name: np.ascontiguousarray(getattr(heads, name)) for name in TENSORS}


@pytest.mark.parametrize("min_votes, trained", [(1, False), (2, True), (5, True)])
def test_save_load_round_trip(tmp_path, min_votes, trained):
    heads = _heads(min_votes=min_votes, trained=trained)
    path = tmp_path / "sub" / "heads.safetensors"  # save creates the parent
    save_heads(heads, path)
    loaded = load_heads(path)
    for name in TENSORS:
        got = getattr(loaded, name)
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, getattr(heads, name))
    assert loaded.fingerprint == FP
    assert loaded.min_votes == min_votes
    assert loaded.trained is trained
    assert loaded.hidden_size == FP.hidden_size


def test_random_heads_shapes_and_seed():
    heads = random_heads(FP, seed=3)
    assert heads.w1.shape == (NUM_HEADS, FP.hidden_size, HIDDEN_WIDTH)
    assert heads.b1.shape == (NUM_HEADS, HIDDEN_WIDTH)
    assert heads.w2.shape == (NUM_HEADS, HIDDEN_WIDTH)
    assert heads.b2.shape == (NUM_HEADS,)
    np.testing.assert_array_equal(heads.thresholds, np.zeros(NUM_HEADS, np.float32))
    assert heads.trained is False
    np.testing.assert_array_equal(heads.w1, random_heads(FP, seed=3).w1)
    assert not np.array_equal(heads.w1, random_heads(FP, seed=4).w1)


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_heads(tmp_path / "absent.safetensors")
    with pytest.raises(FileNotFoundError):
        load_heads(tmp_path)  # a directory is not a heads file


@pytest.mark.parametrize(
    "payload", [b"", b"not a safetensors file at all", b"\xff" * 64], ids=["empty", "text", "garbage"]
)
def test_load_rejects_a_non_safetensors_file(tmp_path, payload):
    path = tmp_path / "heads.safetensors"
    path.write_bytes(payload)
    with pytest.raises(ValueError, match="not a readable safetensors heads file"):
        load_heads(path)


@pytest.mark.parametrize("fmt", ["vllm-pamer-heads/2", "something-else", None])
def test_load_rejects_the_wrong_format(tmp_path, fmt):
    path = tmp_path / "heads.safetensors"
    metadata = _metadata()
    if fmt is None:
        del metadata["format"]
    else:
        metadata["format"] = fmt
    save_file(_tensors(_heads()), str(path), metadata=metadata)
    with pytest.raises(ValueError, match="format") as info:
        load_heads(path)
    assert HEADS_FORMAT in str(info.value)


def test_load_rejects_a_file_without_metadata(tmp_path):
    path = tmp_path / "heads.safetensors"
    save_file(_tensors(_heads()), str(path))
    with pytest.raises(ValueError, match="format"):
        load_heads(path)


@pytest.mark.parametrize(
    "name, shape",
    [
        ("w1", (NUM_HEADS, 32, HIDDEN_WIDTH)),  # hidden size 32 but metadata says 64
        ("w1", (NUM_HEADS, 64, 128)),
        ("b1", (NUM_HEADS, 128)),
        ("w2", (4, HIDDEN_WIDTH)),
        ("b2", (NUM_HEADS, 1)),
        ("thresholds", (3,)),
    ],
)
def test_load_rejects_a_wrong_tensor_shape(tmp_path, name, shape):
    path = tmp_path / "heads.safetensors"
    tensors = _tensors(_heads())
    tensors[name] = np.zeros(shape, dtype=np.float32)
    save_file(tensors, str(path), metadata=_metadata())
    with pytest.raises(ValueError, match=f"tensor {name} has shape") as info:
        load_heads(path)
    assert str(shape) in str(info.value)


def test_load_rejects_missing_tensors(tmp_path):
    path = tmp_path / "heads.safetensors"
    tensors = _tensors(_heads())
    del tensors["thresholds"]
    save_file(tensors, str(path), metadata=_metadata())
    with pytest.raises(ValueError, match=r"missing tensors.*thresholds"):
        load_heads(path)


@pytest.mark.parametrize("min_votes", ["0", "6"])
def test_load_rejects_min_votes_out_of_range(tmp_path, min_votes):
    path = tmp_path / "heads.safetensors"
    save_file(_tensors(_heads()), str(path), metadata=_metadata(min_votes=min_votes))
    with pytest.raises(ValueError, match="min_votes"):
        load_heads(path)


def test_check_model_accepts_the_same_model_under_another_name():
    heads = _heads()
    heads.check_model(FP)
    heads.check_model(ModelFingerprint(FP.architecture, FP.hidden_size, FP.num_hidden_layers, FP.vocab_size, "/other"))


@pytest.mark.parametrize(
    "field, value",
    [("hidden_size", 576), ("architecture", "Qwen2ForCausalLM"), ("num_hidden_layers", 30), ("vocab_size", 49152)],
)
def test_check_model_names_the_differing_field(field, value):
    served = ModelFingerprint(
        **{
            "architecture": FP.architecture,
            "hidden_size": FP.hidden_size,
            "num_hidden_layers": FP.num_hidden_layers,
            "vocab_size": FP.vocab_size,
            "model_name": "served/model",
            field: value,
        }
    )
    with pytest.raises(HeadsMismatch) as info:
        _heads().check_model(served, path="/x/heads.safetensors")
    message = str(info.value)
    assert f"{field}:" in message
    assert repr(getattr(FP, field)) in message and repr(value) in message
    assert "/x/heads.safetensors" in message
    assert isinstance(info.value, ValueError)


def test_fingerprint_from_hf_config():
    class TextConfig:
        hidden_size = 576
        num_hidden_layers = 30
        vocab_size = 49152

    class Config(TextConfig):
        architectures = ["LlamaForCausalLM"]

    fp = ModelFingerprint.from_hf_config(Config(), model_name="smol")
    assert fp == ModelFingerprint("LlamaForCausalLM", 576, 30, 49152, "smol")
