"""vLLM 0.32: capturing model classes, registered over vLLM's own for their
architectures (``registration.py``).

Each class is vLLM's model with one change: ``compute_logits`` first hands its
input rows (the final-norm states vLLM computes for sampling) to the worker's
capture. Nothing else in the forward pass changes, and no extra pass runs.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.models.llama import LlamaForCausalLM
from vllm.model_executor.models.qwen2 import Qwen2ForCausalLM
from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM

from vllm_pamer.adapters.vllm_0_32.worker_v1 import capture_rank, install_runner_hook
from vllm_pamer.core.heads import ModelFingerprint
from vllm_pamer.worker.capture import WorkerCapture, init_worker_capture


class _CaptureMixin:
    _pamer_capture: WorkerCapture | None

    def _init_capture(self, vllm_config: Any) -> None:
        self._pamer_capture = None
        if capture_rank():
            model_config = vllm_config.model_config
            fingerprint = ModelFingerprint.from_hf_config(
                model_config.hf_config, model_name=str(model_config.served_model_name or model_config.model)
            )
            self._pamer_capture = init_worker_capture(fingerprint, vllm_config.device_config.device)
            self._pamer_capture.attach_model(self)
            install_runner_hook()

    def compute_logits(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self._pamer_capture is not None:
            self._pamer_capture.observe(hidden_states)
        return super().compute_logits(hidden_states, *args, **kwargs)  # type: ignore[misc]


class PamerLlamaForCausalLM(_CaptureMixin, LlamaForCausalLM):
    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._init_capture(vllm_config)


class PamerQwen2ForCausalLM(_CaptureMixin, Qwen2ForCausalLM):
    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._init_capture(vllm_config)


class PamerQwen3ForCausalLM(_CaptureMixin, Qwen3ForCausalLM):
    def __init__(self, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
        super().__init__(vllm_config=vllm_config, prefix=prefix, **kwargs)
        self._init_capture(vllm_config)
