"""Shared fixtures. Engine and server fixtures are session-scoped: starting a
vLLM engine costs tens of seconds on two cores, so tests share them."""

from __future__ import annotations

import pytest

from vllm_pamer.adapters.launch import prepare_vllm_cpu

prepare_vllm_cpu()


@pytest.fixture(scope="session")
def default_model_dir():
    from vllm_pamer.default_model import ensure_default_model

    return ensure_default_model(quiet=True)


@pytest.fixture(scope="session")
def tokenizer_dir(default_model_dir):
    """Any real tokenizer works for the tiny models; use the default model's."""
    return default_model_dir


def pytest_collection_modifyitems(config, items):
    # Run the fast tests first, engines last: a broken unit shows up in seconds.
    order = {"e2e": 2, "engine": 1}
    items.sort(key=lambda item: max((order.get(m.name, 0) for m in item.iter_markers()), default=0))
