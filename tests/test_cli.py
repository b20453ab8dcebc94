"""The command table, and start-up errors that are clear and immediate (no engine is started)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest
import torch

from vllm_pamer import cli
from vllm_pamer.core.heads import HeadsMismatch, ModelFingerprint, random_heads, save_heads
from vllm_pamer.settings import Settings
from vllm_pamer.worker.capture import WorkerCapture

OTHER_MODEL = ModelFingerprint(
    "LlamaForCausalLM", hidden_size=64, num_hidden_layers=2, vocab_size=1000, model_name="other"
)


def test_every_command_is_a_function_of_its_module_and_in_the_usage():
    for name, target in cli.COMMANDS.items():
        module, function = target.split(":")
        assert callable(getattr(importlib.import_module(module), function)), name
        assert f"vllm-pamer {name} " in cli.__doc__, name


def _serve(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "vllm_pamer.cli", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serve_refuses_heads_of_another_model(tmp_path, default_model_dir):
    heads = tmp_path / "other.safetensors"
    save_heads(random_heads(OTHER_MODEL), heads)
    result = _serve(str(default_model_dir), "--pamer-heads", str(heads))
    assert result.returncode != 0
    assert "was made for model 'other'" in result.stderr and "hidden_size" in result.stderr


def test_serve_refuses_unknown_policy(default_model_dir):
    result = _serve(str(default_model_dir), "--pamer-policy", "nope")
    assert result.returncode != 0 and "unknown memory policy 'nope'" in result.stderr


def test_worker_refuses_heads_of_another_model(tmp_path):
    """The plain `vllm serve` path: the worker checks the heads at model load."""
    heads = tmp_path / "other.safetensors"
    save_heads(random_heads(OTHER_MODEL), heads)
    served = ModelFingerprint(
        "LlamaForCausalLM", hidden_size=576, num_hidden_layers=30, vocab_size=49152, model_name="x"
    )
    with pytest.raises(HeadsMismatch, match="hidden_size"):
        WorkerCapture(Settings(heads=str(heads)), served, torch.device("cpu"))
    # the matching model loads
    assert WorkerCapture(Settings(heads=str(heads)), OTHER_MODEL, torch.device("cpu")).heads is not None
