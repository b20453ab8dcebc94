"""Held Responses API answers in the SQL stores (the ``responses`` table of
``sqlite.py`` and ``postgres.py``): each answer keeps only the messages its
request added (its output last) and the key of the answer it continues, so a
conversation of n turns is stored once, not n times, and is read back whole
by walking the keys from the newest answer to the first. Rows are filed under
their session, deleted with it (``sql.py``'s retention), and its last use
counts as the session's."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Sequence
from typing import Any

from vllm_pamer.core.blocks import Message
from vllm_pamer.core.store import HeldResponse, StoreError
from vllm_pamer.stores.sql import SqlStore

MAX_TURNS = 100_000
"""Longest conversation read back (a guard: keys only point to older rows)."""

_CHAIN = """
WITH RECURSIVE chain(key, parent, session, session_name, items, response, depth) AS (
    SELECT key, parent, session, session_name, items, response, 0 FROM responses WHERE key = ?
    UNION ALL
    SELECT r.key, r.parent, r.session, r.session_name, r.items, r.response, c.depth + 1
    FROM responses r JOIN chain c ON r.key = c.parent WHERE c.depth < ?
)
SELECT depth, parent, session, session_name, items, response FROM chain ORDER BY depth DESC
"""


class ResponsesSqlStore(SqlStore):
    """``SqlStore`` with held responses."""

    def _hold_response(
        self, key: str, parent: str | None, session: tuple[str, str], items: Sequence[Message], response: dict[str, Any]
    ) -> None:
        now = time.time()
        try:
            with self._lock:
                self._ready()
                with self._transaction():
                    self._execute(
                        "INSERT INTO responses (key, parent, session, session_name, items, response, created) "
                        "VALUES (?,?,?,?,?,?,?)",
                        (key, parent, *session, json.dumps(list(items)), json.dumps(response), now),
                    )
                    self._execute(
                        "INSERT INTO sessions (session, last_used, memories, raw_bytes) VALUES (?,?,0,0) "
                        "ON CONFLICT(session) DO UPDATE SET last_used=excluded.last_used",
                        (session[0], now),
                    )
        except self.errors as exc:
            raise StoreError(f"holding the response failed: {exc}") from exc

    def _held_response(self, key: str) -> HeldResponse | None:
        try:
            with self._lock:
                self._ready()
                rows = self._execute(_CHAIN, (key, MAX_TURNS)).fetchall()
        except self.errors as exc:
            raise StoreError(f"reading the held response failed: {exc}") from exc
        if not rows or rows[0][1] is not None:  # none, or its first turn is gone: never a history with a gap
            return None
        _, _, session, session_name, _, response = rows[-1]
        history: list[Message] = [message for row in rows for message in json.loads(row[4])]
        return HeldResponse(session, session_name, history, json.loads(response))

    async def hold_response(
        self,
        key: str,
        parent: str | None,
        session: tuple[str, str],
        items: Sequence[Message],
        response: dict[str, Any],
    ) -> None:
        await asyncio.to_thread(self._hold_response, key, parent, session, items, response)

    async def held_response(self, key: str) -> HeldResponse | None:
        return await asyncio.to_thread(self._held_response, key)
