"""Which model classes capture (``adapters/vllm_from_0_32/models.py``): every
generative class one capturing subclass, a pooling class none, and the loud
refusal of a Model Runner V2 mode the capture cannot serve."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from vllm_pamer.adapters.vllm_from_0_32.models import UnsupportedRunner, capturing


class Generative(torch.nn.Module):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()
        self.prefix = prefix

    def compute_logits(self, hidden_states):
        return hidden_states * 2


class Pooling(torch.nn.Module):
    def __init__(self, *, vllm_config, prefix=""):
        super().__init__()


def test_every_generative_class_gets_one_capturing_subclass_and_pooling_none():
    made = capturing(Generative)
    # vLLM passes vllm_config and prefix by keyword only to a class whose signature names both
    assert {"vllm_config", "prefix"} <= set(inspect.signature(made.__init__).parameters)
    assert issubclass(made, Generative) and made.__name__ == "PamerGenerative"
    assert capturing(Generative) is made and capturing(made) is made
    assert capturing(Pooling) is Pooling


def _v2_config(**parallel):
    return SimpleNamespace(use_v2_model_runner=True, parallel_config=SimpleNamespace(**parallel))


def test_v2_modes_it_cannot_capture_refuse_to_start(monkeypatch):
    class Sharded(Generative):
        def compute_logits_local(self, hidden_states):
            return hidden_states

    with pytest.raises(UnsupportedRunner, match="batch-sharded sampling"):
        capturing(Sharded)(vllm_config=_v2_config(enable_batch_sharded_sampling=True))
    monkeypatch.setenv("PAMER_CAPTURE_LAYERS", "-1")
    with pytest.raises(UnsupportedRunner, match="PAMER_CAPTURE_LAYERS"):
        capturing(Generative)(vllm_config=_v2_config(enable_batch_sharded_sampling=False))
