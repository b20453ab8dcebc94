"""The worker adapter of vLLM 0.32 without an engine: which classes capture,
and the loud refusal of a model runner it cannot hook."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
import torch

from vllm_pamer.adapters.vllm_0_32.models import UnsupportedRunner, capturing


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


def test_a_model_under_model_runner_v2_refuses_to_start():
    with pytest.raises(UnsupportedRunner, match="VLLM_USE_V2_MODEL_RUNNER=0"):
        capturing(Generative)(vllm_config=SimpleNamespace(use_v2_model_runner=True))
