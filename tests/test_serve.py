"""``vllm-pamer serve`` (``vllm_pamer/serve.py``) refuses a bad start at once,
clearly, before an engine starts."""

from __future__ import annotations

import subprocess
import sys

from vllm_pamer.core.heads import ModelFingerprint, random_heads, save_heads

OTHER_MODEL = ModelFingerprint(
    "LlamaForCausalLM", hidden_size=64, num_hidden_layers=2, vocab_size=1000, model_name="other"
)


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
