"""What the store tests write: a memory of real blocks (``BLOCKS``) committed
straight to a store (``commit``)."""

from __future__ import annotations

import numpy as np

from tests.support.fakes import blocking, conversation
from vllm_pamer.core.blocks import split_conversation
from vllm_pamer.core.policies.summary_writer import step_details

BLOCKS = split_conversation(conversation(6, chars=200)).blocks
VECTOR = np.ones(8, dtype=np.float32)


def commit(store, session, blocks=BLOCKS[:2]):
    """A memory of ``blocks`` committed to ``store`` for ``session``."""
    return blocking(store).commit_memory(session, f"summary of {session}", VECTOR, "test", blocks, step_details(blocks))
