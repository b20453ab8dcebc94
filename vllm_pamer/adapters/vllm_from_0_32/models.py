"""Capture for any generative architecture.

vLLM hands the runner's sampling rows (the final-norm states of the positions
it samples from, ``hidden_states[logits_indices]``) to the model's
``compute_logits``: that call is the seam, the same in the V1 runner and in
Model Runner V2 (each runner's adapter, ``worker_v1.py`` and ``worker_v2.py``,
tells the capture which request each row is). ``capturing(cls)`` makes, once per model class, a subclass
whose ``compute_logits`` first hands those rows to the worker's capture;
``registration.py`` returns it wherever vLLM resolves an architecture, so every
model vLLM serves is captured, its own classes and out-of-tree ones alike.
Nothing else in the forward pass changes, and no extra pass runs.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any

import torch

from vllm_pamer.adapters.vllm_from_0_32 import worker_v1, worker_v2
from vllm_pamer.adapters.vllm_from_0_32.worker_v1 import capture_rank
from vllm_pamer.channel import WORKER_EXTENSION
from vllm_pamer.core.heads import ModelFingerprint
from vllm_pamer.settings import Settings
from vllm_pamer.worker.capture import WorkerCapture, init_worker_capture

logger = logging.getLogger("vllm_pamer.capture")


class UnsupportedRunner(RuntimeError):
    """The engine runs a model runner, or a mode of it, the plugin cannot capture."""


def _runner_hooks(vllm_config: Any) -> ModuleType:
    """The adapter of the runner vLLM chose (V1 or Model Runner V2)."""
    return worker_v2 if getattr(vllm_config, "use_v2_model_runner", False) else worker_v1


class _CaptureMixin:
    _pamer_capture: WorkerCapture | None

    @classmethod
    def _check_runner(cls, vllm_config: Any) -> None:
        hooks = _runner_hooks(vllm_config)
        reason = hooks.check_runner(vllm_config, cls)
        if reason is None and hooks is worker_v2 and Settings.from_env().capture_layers:
            reason = (
                "PAMER_CAPTURE_LAYERS (training extraction) taps layers in the V1 runner only; "
                "set VLLM_USE_V2_MODEL_RUNNER=0"
            )
        if reason is not None:  # never a silent "captured": false on every response
            raise UnsupportedRunner(
                f"vllm-pamer cannot capture in this engine: {reason}; "
                "or serve without the plugin (vllm-pamer serve --pamer-off)"
            )

    def _init_capture(self, vllm_config: Any) -> None:
        self._pamer_capture = None
        if capture_rank():
            model_config = vllm_config.model_config
            fingerprint = ModelFingerprint.from_hf_config(
                model_config.hf_config, model_name=str(model_config.served_model_name or model_config.model)
            )
            extension = str(getattr(vllm_config.parallel_config, "worker_extension_cls", "") or "")
            self._pamer_capture = init_worker_capture(
                fingerprint, vllm_config.device_config.device, memory=WORKER_EXTENSION in extension
            )
            self._pamer_capture.attach_model(self)
            _runner_hooks(vllm_config).install_runner_hook()

    def compute_logits(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self._pamer_capture is not None:
            try:
                self._pamer_capture.observe(hidden_states)
            except Exception:  # never the engine's step: that request is reported not captured
                if not getattr(self, "_pamer_failed", False):
                    logger.exception("vllm-pamer: the capture failed in this step (logged once)")
                    self._pamer_failed = True
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
