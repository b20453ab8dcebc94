"""Shared fixtures. Engine and server fixtures are session-scoped: starting a
vLLM engine costs tens of seconds on two cores, so tests share them."""

from __future__ import annotations

import pytest

from vllm_pamer.adapters import UnsupportedVllm

try:
    from vllm_pamer.adapters.launch import prepare_vllm_cpu
except UnsupportedVllm:  # the GPU check machine has no vLLM: kernels and recall only (scripts/gpu_check.sh)
    pass
else:
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


@pytest.fixture(scope="session")
def pg_cluster():
    """A throw-away PostgreSQL cluster (``tests/support/postgres.py``) for the session."""
    from tests.support.postgres import Cluster

    try:
        cluster = Cluster().start()
    except FileNotFoundError as exc:  # the server binaries are on this project's machines and CI
        pytest.skip(str(exc))
    yield cluster
    cluster.stop()


@pytest.fixture
def store(tmp_path):
    """A SQLite memory store on this test's own file (the policy tests' store)."""
    from vllm_pamer.stores.sqlite import SqliteStore

    return SqliteStore(tmp_path / "memory.sqlite3", model_fingerprint="test")


@pytest.fixture(params=["sqlite", "postgres"])
def make_store(request, tmp_path):
    """``make_store(limits=...)``: a store object on this test's own database,
    one per backend; each call opens another object on the same database (a
    reopen, or a second replica)."""
    from vllm_pamer.stores import open_store

    location = (
        str(tmp_path / "memory.sqlite3")
        if request.param == "sqlite"
        else request.getfixturevalue("pg_cluster").new_database()
    )
    opened = []

    def make(limits=None, model_fingerprint="test"):
        opened.append(open_store(location, model_fingerprint=model_fingerprint, limits=limits))
        return opened[-1]

    make.backend = request.param
    yield make
    for store in opened:
        store.close()
