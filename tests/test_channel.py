"""Capture channel: CapturePublisher (PUSH) -> CaptureInbox (PULL), in one
process; records reach the inbox whose tag their key carries."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time

import msgspec
import numpy as np
import pytest
import zmq

from vllm_pamer.channel import CHANNEL_ENV, CaptureInbox, CapturePublisher, CaptureReceiver, CaptureRecord


@pytest.fixture
def address(tmp_path):
    """A fresh ipc:// address (unix socket paths are limited to ~107 bytes)."""
    path = tmp_path / "c.sock"
    if len(str(path)) < 100:
        yield f"ipc://{path}"
        return
    short = tempfile.mkdtemp(prefix="pamer-")
    try:
        yield f"ipc://{short}/c.sock"
    finally:
        shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def publishers():
    made: list[CapturePublisher] = []

    def make(address):
        publisher = CapturePublisher(address)
        made.append(publisher)
        return publisher

    yield make
    for publisher in made:
        for socket in publisher._sockets.values():
            socket.close()


TAG = "a1"


def key(i: int, tag: str = TAG) -> str:
    return f"{tag}.{i:032x}"


def _record(i: int, tag: str = TAG) -> CaptureRecord:
    hidden = (np.arange(16, dtype=np.float32) * (i + 1) - 3.5).astype("<f4")
    return CaptureRecord(
        key=key(i, tag),
        request_id=f"req-{i}",
        session_id=None if i == 1 else f"sess-{i}",
        num_prompt_tokens=100 + i,
        hidden=hidden.tobytes(),
        head_logits=[0.5 * i, -1.25, 3.0, 0.0, -0.125] if i != 2 else None,
        votes=i,
        compress_vote=i % 2 == 0,
        heads_error="no heads" if i == 2 else None,
    )


async def _until(condition, timeout: float = 2.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.005)


def test_publisher_to_inbox(address, publishers):
    records = [_record(i) for i in range(3)]

    async def scenario():
        inbox = CaptureInbox(address, tag=TAG)
        inbox.start()
        try:
            publisher = publishers(address)
            # k0 arrives before anybody waits for it
            publisher.publish(records[0])
            await _until(lambda: inbox.received == 1)
            early = await asyncio.wait_for(inbox.wait_for(key(0), timeout=0.2), 0.1)  # no waiting needed

            # k1, k2: waiters first, then the records
            waiters = [asyncio.ensure_future(inbox.wait_for(key(i), timeout=2.0)) for i in (1, 2)]
            await asyncio.sleep(0.01)
            publisher.publish(records[2])
            publisher.publish(records[1])
            late = await asyncio.gather(*waiters)

            start = time.monotonic()
            missing = await inbox.wait_for("unknown", timeout=0.2)
            waited = time.monotonic() - start
            again = await inbox.wait_for(key(0), timeout=0.05)  # handed out once only
            return early, late, missing, waited, again, inbox.received, publisher.dropped
        finally:
            inbox.close()

    early, late, missing, waited, again, received, dropped = asyncio.run(scenario())
    for got, want in zip([early, *late], records):
        assert got == want
        assert got.hidden_state().dtype == np.float32
        np.testing.assert_array_equal(got.hidden_state(), np.frombuffer(want.hidden, dtype="<f4"))
        np.testing.assert_array_equal(got.hidden_state(), (np.arange(16) * (int(want.key[3:], 16) + 1) - 3.5))
    assert missing is None
    assert 0.19 <= waited < 1.0
    assert again is None
    assert received == 3
    assert dropped == 0


def test_inbox_skips_undecodable_payloads_and_keyless_records(address):
    async def scenario():
        inbox = CaptureInbox(address, tag=TAG)
        inbox.start()
        # one socket, so the payloads arrive in the order sent
        raw = zmq.Context.instance().socket(zmq.PUSH)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(inbox.address)
        try:
            raw.send(b"\x00not msgpack")
            raw.send(msgspec.msgpack.encode(42))  # msgpack, but not a record
            raw.send(msgspec.msgpack.encode(msgspec.structs.replace(_record(5), key=None)))
            raw.send(msgspec.msgpack.encode(_record(6)))
            got = await inbox.wait_for(key(6), timeout=2.0)
            return got, inbox.received, dict(inbox._records)
        finally:
            raw.close()
            inbox.close()

    got, received, pending = asyncio.run(scenario())
    assert got == _record(6)  # the receive loop survived the bad payloads
    assert received == 2  # the keyless record counts, the undecodable ones do not
    assert pending == {}  # the keyless record is not filed


def test_inbox_keeps_a_bounded_number_of_unclaimed_records(address, publishers):
    async def scenario():
        inbox = CaptureInbox(address, max_pending=2, tag=TAG)
        inbox.start()
        try:
            publisher = publishers(address)
            for i in range(3):
                publisher.publish(_record(i))
            await _until(lambda: inbox.received == 3)
            return [await inbox.wait_for(key(i), timeout=0.05) for i in range(3)]
        finally:
            inbox.close()

    oldest, k1, k2 = asyncio.run(scenario())
    assert oldest is None  # evicted
    assert k1 == _record(1) and k2 == _record(2)


def test_publisher_without_address_drops_and_counts(monkeypatch):
    monkeypatch.delenv(CHANNEL_ENV, raising=False)
    publisher = CapturePublisher(None)
    assert publisher.address is None
    for i in range(3):
        publisher.publish(_record(i))  # must not raise
    assert publisher.dropped == 3


def test_publisher_takes_the_address_from_the_environment(monkeypatch, address, publishers):
    monkeypatch.setenv(CHANNEL_ENV, address)
    publisher = publishers(None)
    assert publisher.address == address
    assert publisher._socket is not None


def test_publisher_to_receiver_with_layer_taps(address, publishers):
    """The offline end (extraction): blocking receive, undecodable payloads
    skipped, layer states travel with the record."""
    receiver = CaptureReceiver(address)
    try:
        push = zmq.Context.instance().socket(zmq.PUSH)
        push.connect(address)
        push.send(b"not msgpack")
        push.close(linger=1000)
        hidden = np.arange(4, dtype="<f4")
        layers = np.arange(2 * 3 * 4, dtype="<f4").reshape(2, 3, 4)
        publisher = publishers(address)
        publisher.publish(
            CaptureRecord(
                key="a",
                request_id="r",
                session_id=None,
                num_prompt_tokens=9,
                hidden=hidden.tobytes(),
                layers=layers.tobytes(),
                layer_tokens=9,
            )
        )
        publisher.publish(msgspec.structs.replace(_record(1), key="b"))
        records = receiver.drain(expect=2, timeout_s=5.0)
        assert [r.key for r in records] == ["a", "b"]
        np.testing.assert_array_equal(records[0].layer_states(), layers)
        assert records[0].layer_tokens == 9 and records[1].layer_states() is None
        assert receiver.receive(10) is None
    finally:
        receiver.close()
    assert receiver.receive(10) is None  # closed: nothing, no error


def test_each_api_process_gets_the_records_of_its_own_keys(address, publishers):
    """Two inboxes on one channel (``--api-server-count 2``) and one worker:
    a record goes to the inbox whose tag its key carries; a key without a
    well-formed tag goes to the channel address itself (offline capture)."""

    async def scenario():
        first, second = CaptureInbox(address, tag="1f"), CaptureInbox(address, tag="2e")
        offline = CaptureReceiver(address)
        for inbox in (first, second):
            inbox.start()
        try:
            assert first.new_key().startswith("1f.") and first.address == f"{address}.1f"
            publisher = publishers(address)
            for i in range(4):
                publisher.publish(_record(i, "1f" if i % 2 == 0 else "2e"))
            forged = msgspec.structs.replace(_record(9), key="../../x.0123")
            publisher.publish(forged)
            await _until(lambda: first.received + second.received == 4)
            got_first = [await first.wait_for(key(i, "1f"), 0.05) for i in range(4)]
            got_second = [await second.wait_for(key(i, "2e"), 0.05) for i in range(4)]
            return got_first, got_second, offline.receive(2000), first.received, second.received
        finally:
            first.close()
            second.close()
            offline.close()

    got_first, got_second, stray, n_first, n_second = asyncio.run(scenario())
    assert [r is not None for r in got_first] == [True, False, True, False]
    assert [r is not None for r in got_second] == [False, True, False, True]
    assert n_first == n_second == 2
    assert stray is not None and stray.key == "../../x.0123"


def test_a_key_naming_an_unbound_process_is_dropped_not_queued(address, publishers):
    """A forged or stale tag (no API process binds its address): the record is
    dropped and counted, no socket is opened, nothing queues in the worker."""
    publisher = publishers(address)
    publisher.publish(_record(0, "dead"))
    publisher.publish(msgspec.structs.replace(_record(1), key=None))  # wanted by nobody: not sent
    assert publisher.dropped == 1 and publisher._sockets == {}
