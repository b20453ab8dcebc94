"""The API server's engine services (``server/services.py``) keep the worker's
memory rows in step: only what the worker lacks is pushed, a failed push is
sent again and never raises, nothing without the worker extension."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tests.support.memories import memories


class Workers:
    """The engine client's ``collective_rpc``, as the API server calls it."""

    def __init__(self, fail=False):
        self.calls, self.fail = [], fail
        extension = "vllm_pamer.worker.extension.PamerWorkerExtension"
        self.vllm_config = SimpleNamespace(parallel_config=SimpleNamespace(worker_extension_cls=extension))

    async def collective_rpc(self, method, timeout=None, args=()):
        self.calls.append((method, timeout, args))
        if self.fail:
            raise TimeoutError("no answer")
        return [None]


def _services(workers):
    from vllm_pamer.server.services import VllmEngineServices

    return VllmEngineServices(workers, None, None, 2048, 1.0, 1)


def test_the_api_server_pushes_only_what_the_worker_lacks():
    async def scenario():
        workers = Workers()
        services = _services(workers)
        ms = memories("s", 3, 1)
        services.sync_memories("s", ms, held=[1, 2, 3])  # held already: nothing to send
        services.sync_memories("s", ms + memories("s", 1, 2, start=9), held=[1, 2, 3])
        services.sync_memories("s", ms + memories("s", 1, 2, start=9), held=[1, 2, 3])  # on its way: not again
        await asyncio.sleep(0.01)
        [(method, timeout, (session, keep, add))] = workers.calls
        assert method == "pamer_memory_sync" and timeout is None and session == "s"
        assert keep == [1, 2, 3] and [i for i, _ in add] == [9]
        services.drop_memories("s")
        await asyncio.sleep(0.01)
        assert workers.calls[-1][0] == "pamer_memory_drop"

    asyncio.run(scenario())


def test_a_failed_push_never_raises_and_is_sent_again():
    async def scenario():
        workers = Workers(fail=True)
        services = _services(workers)
        services.sync_memories("s", memories("s", 2, 1))
        await asyncio.sleep(0.01)
        assert len(workers.calls) == 1

    asyncio.run(scenario())
    services = _services(Workers())
    services.sync_memories("s", memories("s", 2, 1))  # no event loop here: left to the API server's search
    assert services._pushed == {}


def test_no_push_without_the_worker_extension():
    workers = Workers()
    workers.vllm_config.parallel_config.worker_extension_cls = ""
    assert not _services(workers).worker_memory
