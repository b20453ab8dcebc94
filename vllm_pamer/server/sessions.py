"""Per-session state kept by the API server (in memory; bounded LRU), and
kept in the store too (written by ``ServerState.on_capture``, read back by
``ServerState.newer_stored``, both in ``server/state.py``).

The vote captured at a request's prefill is filed on its session, so that the
session's next request can act on it (the deferred decision: no request
waits for an extra forward pass). The store's copy carries it to a restarted
server, to another API process (``--api-server-count``) and to another replica.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import msgspec
import numpy as np

from vllm_pamer.channel import CaptureRecord
from vllm_pamer.core.policies import HeadVote
from vllm_pamer.core.recall import WorkerRecall


class SessionState(msgspec.Struct):
    session_id: str
    requests: int = 0
    captures: int = 0
    last_vote: HeadVote | None = None
    last_action: str | None = None
    last_prompt_tokens: int | None = None
    last_seen: float = 0.0
    last_state: bytes | None = None
    """Final-norm state of the last captured prefill (float32), for retrieval."""
    last_recall: WorkerRecall | None = None
    """The worker's Top-K of the session's memories for ``last_state``."""
    last_schedule: dict[str, Any] | None = None
    """The compaction schedule's report of the session's last request."""
    policy: str | None = None
    """The policy of the session's last request."""
    updated: float = 0.0
    """Unix time of the last capture filed here (the newer of two copies wins)."""

    def record_capture(self, record: CaptureRecord) -> None:
        self.updated = time.time()
        self.captures += 1
        self.last_prompt_tokens = record.num_prompt_tokens
        self.last_state = record.hidden
        self.last_recall = record.recall
        self.last_vote = (
            HeadVote(tuple(record.head_logits), int(record.votes or 0), bool(record.compress_vote))
            if record.head_logits is not None
            else None
        )

    def encode(self) -> bytes:
        return _encoder.encode(self)

    @staticmethod
    def decode(payload: bytes) -> SessionState:
        return _decoder.decode(payload)

    def state(self) -> np.ndarray | None:
        """The last captured state as a float32 vector (None: none captured)."""
        return None if self.last_state is None else np.frombuffer(self.last_state, dtype="<f4")

    def summary(self) -> dict[str, Any]:
        state = self.state()
        return {
            "session_id": self.session_id,
            "policy": self.policy,
            "requests": self.requests,
            "captures": self.captures,
            "last_action": self.last_action,
            "last_prompt_tokens": self.last_prompt_tokens,
            "last_vote": None if self.last_vote is None else msgspec.to_builtins(self.last_vote),
            "last_state_norm": None if state is None else float(np.linalg.norm(state)),
            "last_schedule": self.last_schedule,
        }


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(SessionState)


class SessionRegistry:
    def __init__(self, max_sessions: int = 100_000, on_evict: Callable[[str], None] | None = None) -> None:
        """``on_evict(session_id)`` runs when a session leaves the registry
        (least recently used first), e.g. to free its device-resident rows."""
        self.max_sessions = max_sessions
        self.on_evict = on_evict
        self._sessions: OrderedDict[str, SessionState] = OrderedDict()

    def get(self, session_id: str) -> SessionState | None:
        return self._sessions.get(session_id)

    def touch(self, session_id: str, newer: SessionState | None = None) -> SessionState:
        """The session's state, marked used; ``newer`` (from the store)
        replaces it if it is newer still (a capture may have come meanwhile)."""
        state = self._sessions.pop(session_id, None)
        if newer is not None and newer.session_id == session_id and (state is None or newer.updated > state.updated):
            state = newer
        state = state or SessionState(session_id)
        state.last_seen = time.time()
        self._sessions[session_id] = state
        while len(self._sessions) > self.max_sessions:
            evicted, _ = self._sessions.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(evicted)
        return state

    def __len__(self) -> int:
        return len(self._sessions)
