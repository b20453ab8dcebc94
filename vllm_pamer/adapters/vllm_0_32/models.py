"""vLLM 0.32: capture for any generative architecture.

vLLM hands the runner's sampling rows (the final-norm states of the positions
it samples from, ``hidden_states[logits_indices]``) to the model's
``compute_logits``: that call is the seam, the same in the V1 runner and in
Model Runner V2. ``capturing(cls)`` makes, once per model class, a subclass
whose ``compute_logits`` first hands those rows to the worker's capture;
``registration.py`` returns it wherever vLLM resolves an architecture, so every
model vLLM serves is captured, its own classes and out-of-tree ones alike.
Nothing else in the forward pass changes, and no extra pass runs.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_pamer.adapters.vllm_0_32.worker_v1 import capture_rank, install_runner_hook
from vllm_pamer.core.heads import ModelFingerprint
from vllm_pamer.worker.capture import WorkerCapture, init_worker_capture


class UnsupportedRunner(RuntimeError):
    """The engine runs a model runner the plugin has no adapter for."""


class _CaptureMixin:
    _pamer_capture: WorkerCapture | None

    @staticmethod
    def _check_runner(vllm_config: Any) -> None:
        if getattr(vllm_config, "use_v2_model_runner", False):
            # the step view hooks the V1 runner: under V2 every response would say captured: false
            raise UnsupportedRunner(
                "vllm-pamer's adapter for vLLM 0.32 captures with the V1 model runner, and this engine runs "
                "Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1, or a feature that needs it); start it with "
                "VLLM_USE_V2_MODEL_RUNNER=0, or serve without the plugin (vllm-pamer serve --pamer-off)"
            )

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


_CAPTURING: dict[type, type] = {}


def capturing(cls: type) -> type:
    """``cls`` with capture, or ``cls`` itself when it computes no logits (a
    pooling model) or already captures."""
    if not callable(getattr(cls, "compute_logits", None)) or issubclass(cls, _CaptureMixin):
        return cls
    if cls not in _CAPTURING:
        # vLLM reads the signature: ``vllm_config`` and ``prefix`` by keyword
        def init(self: Any, *, vllm_config: Any, prefix: str = "", **kwargs: Any) -> None:
            self._check_runner(vllm_config)  # before the weights are built
            cls.__init__(self, vllm_config=vllm_config, prefix=prefix, **kwargs)  # type: ignore[call-arg]
            self._init_capture(vllm_config)

        name = f"Pamer{cls.__name__}"
        made = type(name, (_CaptureMixin, cls), {"__init__": init, "__qualname__": name})
        globals()[name] = made  # found by name, as pickle and torch.compile's caches look classes up
        _CAPTURING[cls] = made
    return _CAPTURING[cls]
