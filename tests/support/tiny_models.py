"""Tiny random-weight models, built at test time in seconds."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

ARCHITECTURES: dict[str, dict] = {
    # kind (a transformers model type) -> what it needs beyond the common config
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 64},  # CPU attention needs head_dim 64+
    "qwen3_moe": {"head_dim": 64, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64},
    "mistral": {"head_dim": 64, "sliding_window": None},
    "gemma2": {"head_dim": 64, "query_pre_attn_scalar": 64, "sliding_window": 512},
    "phi3": {"pad_token_id": 0},
    "granite": {},
    "olmo2": {},
}
"""The architectures the capture tests build (``tests/worker/test_capture_engine.py``)."""


def build_tiny_model(kind: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """A 2-layer model of architecture ``kind`` (a key of ``ARCHITECTURES``),
    fp32, with the tokenizer of ``tokenizer_dir``."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    common = dict(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    config = CONFIG_MAPPING[kind](**{**common, **ARCHITECTURES[kind]})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    # random init has tiny norms; spread the weights so states are not degenerate
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.08)
    out_dir = Path(out_dir)
    shutil.rmtree(out_dir, ignore_errors=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def hf_last_token_states(model_dir: Path, prompts: list[list[int]]) -> torch.Tensor:
    """HF transformers' final-norm state of each prompt's last token (fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for ids in prompts:
            out = model.model(input_ids=torch.tensor([ids]))
            rows.append(out.last_hidden_state[0, -1])
    return torch.stack(rows)
