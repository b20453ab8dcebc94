"""Capture channel: worker -> API server, one message per captured prefill.

The worker that computed the final hidden state pushes a small msgpack record
(head logits, votes, the compress vote, the state itself) on a ZeroMQ PUSH socket; the
API server's endpoint plugin binds the PULL end and files each record under the
capture key it put into the request's ``vllm_xargs``. Pushing never blocks the
engine: when nobody listens (offline ``LLM`` use, or the queue is full) records
are dropped and counted.

The address travels in the ``channel`` setting, ``PAMER_CHANNEL`` (inherited
by the engine processes); ``ensure_channel_address`` picks a fresh ipc path in the first
process that loads the plugin.

Under ``--api-server-count N`` each API process binds an address of its own,
the channel address plus its tag, and its capture keys start with that tag
(``CaptureInbox.new_key``): the worker pushes each record to the process that
sent the request (vLLM routes only the engine's outputs back to their API
process, ``client_index``; the worker never sees which one it was).
"""

from __future__ import annotations

import asyncio
import os
import re
import tempfile
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
import numpy as np

from vllm_pamer.core.recall import WorkerRecall
from vllm_pamer.settings import Settings

if TYPE_CHECKING:
    import zmq
    import zmq.asyncio

CHANNEL_ENV = Settings.env_name("channel")
CAPTURE_KEY = "pamer_capture"
"""``SamplingParams.extra_args`` key that names a request's capture."""
SESSION_KEY = "pamer_session"
WORKER_EXTENSION = "vllm_pamer.worker.extension.PamerWorkerExtension"
"""vLLM's ``--worker-extension-cls`` that lets the API server push memory rows
to the worker (``worker/extension.py``)."""
_TAGGED_KEY = re.compile(r"([0-9a-f]{1,16})\.[0-9a-f]{32}")
"""A capture key of an API process: its tag, a dot, a random uuid."""
MAX_PUSH_SOCKETS = 64
"""Reply addresses a worker keeps connected (API processes, with restarts)."""


def reply_address(channel: str, key: str | None) -> str:
    """Where the record of ``key`` goes: the channel address plus the key's
    tag, or the channel address itself (offline capture, untagged keys, a
    non-``ipc://`` channel, which has one receiving end). The tag is checked,
    so a key can name no address outside the channel's."""
    match = _TAGGED_KEY.fullmatch(key or "")
    return f"{channel}.{match.group(1)}" if match and channel.startswith("ipc://") else channel


class CaptureRecord(msgspec.Struct, array_like=True):
    """What the worker captured at one request's completed prompt prefill."""

    key: str | None
    """Capture key from extra_args (None when the request carried none)."""
    request_id: str
    """vLLM's internal request id."""
    session_id: str | None
    num_prompt_tokens: int
    hidden: bytes
    """Final-norm state of the last prompt token, float32, little endian."""
    head_logits: list[float] | None = None
    votes: int | None = None
    compress_vote: bool | None = None
    """At least ``min_votes`` heads fired."""
    heads_error: str | None = None
    """Why the heads could not be evaluated (the probe-failure fallback)."""
    layers: bytes | None = None
    """Layer taps (``PAMER_CAPTURE_LAYERS``): ``[2, n_taps, d]`` float32, the
    last prompt token then the mean over the prompt's computed tokens."""
    layer_tokens: int | None = None
    """Prompt tokens the mean covers (fewer than the prompt on a prefix-cache hit)."""
    recall: WorkerRecall | None = None
    """The worker's Top-K of the session's memories for this state (None: the
    worker held none of them, or the request had no session)."""

    def hidden_state(self) -> np.ndarray:
        return np.frombuffer(self.hidden, dtype="<f4")

    def layer_states(self) -> np.ndarray | None:
        """``[2, n_taps, d]`` (last, mean) or None when no layers were tapped."""
        if self.layers is None:
            return None
        width = len(self.hidden) // 4
        return np.frombuffer(self.layers, dtype="<f4").reshape(2, -1, width)


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(CaptureRecord)


def ensure_channel_address() -> str:
    address = os.environ.get(CHANNEL_ENV)
    if not address:
        path = os.path.join(tempfile.gettempdir(), f"vllm-pamer-{uuid.uuid4().hex[:12]}.sock")
        address = f"ipc://{path}"
        os.environ[CHANNEL_ENV] = address
    return address


class CapturePublisher:
    """Worker side: non-blocking PUSH of capture records, one socket per
    reply address (``reply_address``), the least recently used closed first."""

    def __init__(self, address: str | None = None, high_water_mark: int = 10_000) -> None:
        import zmq

        self.address = address or os.environ.get(CHANNEL_ENV)
        self.dropped = 0
        self._zmq = zmq
        self._high_water_mark = high_water_mark
        self._sockets: OrderedDict[str, zmq.SyncSocket] = OrderedDict()

    def _socket(self, address: str) -> zmq.SyncSocket | None:
        """The connected socket of ``address``; None for an ipc address that
        nobody binds (a forged key, a stopped API process): its records would
        queue in this worker until the high-water mark."""
        socket = self._sockets.pop(address, None)
        if socket is None:
            if address != self.address and address.startswith("ipc://") and not os.path.exists(address[6:]):
                return None
            socket = self._zmq.Context.instance().socket(self._zmq.PUSH)
            socket.setsockopt(self._zmq.SNDHWM, self._high_water_mark)
            socket.setsockopt(self._zmq.LINGER, 0)
            socket.connect(address)
            while len(self._sockets) >= MAX_PUSH_SOCKETS:
                self._sockets.popitem(last=False)[1].close()
        self._sockets[address] = socket
        return socket

    def publish(self, record: CaptureRecord) -> None:
        """Send ``record`` to the API process that asked for it; a record
        without a key is wanted by nobody and not sent."""
        if record.key is None:
            return
        socket = self._socket(reply_address(self.address, record.key)) if self.address else None
        if socket is None:
            self.dropped += 1
            return
        try:
            socket.send(_encoder.encode(record), flags=self._zmq.NOBLOCK)
        except self._zmq.ZMQError:  # a full queue (Again) or a broken endpoint: never fail the step
            self.dropped += 1


class CaptureReceiver:
    """Offline side (extraction, tests): a blocking PULL end bound here."""

    def __init__(self, address: str) -> None:
        import zmq

        self.address = address
        self._socket: zmq.SyncSocket | None = zmq.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(address)

    def receive(self, timeout_ms: int) -> CaptureRecord | None:
        """The next record, or None when none came within ``timeout_ms`` (or it did not decode)."""
        if self._socket is None or not self._socket.poll(timeout_ms):
            return None
        try:
            return _decoder.decode(self._socket.recv())
        except msgspec.DecodeError:
            return None

    def drain(self, expect: int, timeout_s: float = 10.0) -> list[CaptureRecord]:
        """Records until ``expect`` have come and the channel is quiet, or ``timeout_s``."""
        records: list[CaptureRecord] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            record = self.receive(100)
            if record is not None:
                records.append(record)
            elif len(records) >= expect:
                break
        return records

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None


class CaptureInbox:
    """API-server side: receives records and hands each to whoever waits for
    its key. Unclaimed records expire (bounded memory). It binds the channel
    address plus ``tag`` (this process's id by default)."""

    def __init__(
        self,
        channel: str,
        max_pending: int = 4096,
        tag: str | None = None,
        on_record: Callable[[CaptureRecord], None] | None = None,
    ) -> None:
        self.tag = tag or f"{os.getpid():x}"
        self.on_record = on_record
        self.address = reply_address(channel, self.new_key())
        self.max_pending = max_pending
        self.received = 0
        self._records: OrderedDict[str, tuple[float, CaptureRecord]] = OrderedDict()
        self._waiters: dict[str, asyncio.Future] = {}
        self._task: asyncio.Task | None = None
        self._socket: zmq.asyncio.Socket | None = None

    def start(self) -> None:
        import zmq
        import zmq.asyncio

        if self.address.startswith("ipc://"):
            path = self.address[len("ipc://") :]
            if os.path.exists(path):
                os.unlink(path)  # stale socket of a killed server
        self._socket = zmq.asyncio.Context.instance().socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(self.address)
        self._task = asyncio.get_running_loop().create_task(self._receive_forever(self._socket))

    def new_key(self) -> str:
        """A fresh capture key whose record comes back to this inbox."""
        return f"{self.tag}.{uuid.uuid4().hex}"

    async def _receive_forever(self, socket: zmq.asyncio.Socket) -> None:
        while True:
            payload = await socket.recv()
            try:
                record = _decoder.decode(payload)
            except msgspec.DecodeError:
                continue
            self.received += 1
            if self.on_record is not None:
                self.on_record(record)
            if record.key is None:
                continue
            waiter = self._waiters.pop(record.key, None)
            if waiter is not None and not waiter.done():
                waiter.set_result(record)
                continue
            self._records[record.key] = (time.monotonic(), record)
            while len(self._records) > self.max_pending:
                self._records.popitem(last=False)

    async def wait_for(self, key: str, timeout: float) -> CaptureRecord | None:
        """The record for ``key``, waiting up to ``timeout`` seconds for it."""
        entry = self._records.pop(key, None)
        if entry is not None:
            return entry[1]
        future = asyncio.get_running_loop().create_future()
        self._waiters[key] = future
        try:
            return await asyncio.wait_for(future, timeout)
        except asyncio.TimeoutError:
            return None
        finally:
            self._waiters.pop(key, None)

    def forget(self, key: str) -> None:
        """Drop a record nobody will ask for (the request failed)."""
        self._records.pop(key, None)

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
        if self._socket is not None:
            self._socket.close()
        if self.address.startswith("ipc://"):
            try:
                os.unlink(self.address[len("ipc://") :])
            except OSError:
                pass
