"""What the plugin reads of a model's Hugging Face config (a model directory
or a hub name): the fingerprint heads files are checked against, and its window."""

from __future__ import annotations

from pathlib import Path

from vllm_pamer.core.heads import ModelFingerprint


def model_fingerprint(model: str | Path, model_name: str | None = None) -> ModelFingerprint:
    """The fingerprint of ``model``, from its config."""
    from transformers import AutoConfig

    return ModelFingerprint.from_hf_config(AutoConfig.from_pretrained(str(model)), model_name or Path(str(model)).name)


def model_max_len(model: str | Path) -> int:
    """The model's own window (``max_position_embeddings``)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model))
    config = getattr(config, "text_config", None) or config
    return int(config.max_position_embeddings)
