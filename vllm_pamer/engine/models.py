"""Capturing model classes, registered over vLLM's own for their architectures.

Each class is vLLM's model with one change: ``compute_logits`` first hands its
input rows (the final-norm states vLLM computes for sampling) to the worker's
capture. Nothing else in the forward pass changes, and no extra pass runs.
"""

from __future__ import annotations

import torch

from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from vllm_pamer.engine.capture import init_worker_capture
from vllm_pamer.engine.vllm_adapter import capture_rank, install_runner_hook


class _CaptureMixin:
    def _init_capture(self, vllm_config) -> None:
        self._pamer_capture = None
        if capture_rank():
            self._pamer_capture = init_worker_capture(vllm_config, vllm_config.device_config.device)
            self._pamer_capture.attach_model(self)
            install_runner_hook()

    def compute_logits(self, hidden_states: torch.Tensor, *args, **kwargs):
        if self._pamer_capture is not None:
            self._pamer_capture.observe(hidden_states)
        return super().compute_logits(hidden_states, *args, **kwargs)


class PamerLlamaForCausalLM(_CaptureMixin, LlamaForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._init_capture(vllm_config)


class PamerQwen2ForCausalLM(_CaptureMixin, Qwen2ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._init_capture(vllm_config)


class PamerQwen3ForCausalLM(_CaptureMixin, Qwen3ForCausalLM):
    def __init__(self, *, vllm_config, prefix: str = "", **kwargs) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._init_capture(vllm_config)


CAPTURING_MODELS = {
    "LlamaForCausalLM": "PamerLlamaForCausalLM",
    "Qwen2ForCausalLM": "PamerQwen2ForCausalLM",
    "Qwen3ForCausalLM": "PamerQwen3ForCausalLM",
}
