"""The one view every policy takes of a request: C_eff, then P / O / R.

* **C_eff**: the request without the raw blocks a committed memory of the
  session already covers (block identity is ``core.blocks.block_id``, so a
  resent history matches);
* **P**: the prefix (system messages and the task);
* **R**: the ``retained_blocks`` most recent live blocks (0: none);
* **O**: the live blocks before R.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import msgspec

from vllm_pamer.core.blocks import Block, Conversation, Message, split_recent
from vllm_pamer.core.store import Memory


def flatten(blocks: Iterable[Block]) -> list[Message]:
    """The messages of ``blocks``, in order."""
    return [m for b in blocks for m in b.messages]


class ContextView(msgspec.Struct, frozen=True):
    prefix: tuple[Message, ...]
    """P."""
    old: tuple[Block, ...]
    """O: live blocks before R."""
    recent: tuple[Block, ...]
    """R: the most recent live blocks."""
    covered: int = 0
    """Blocks of the request left out because a memory covers them."""

    @property
    def live(self) -> tuple[Block, ...]:
        """The blocks of C_eff: O then R."""
        return self.old + self.recent

    def messages(self, *, old: bool = True) -> list[Message]:
        """C_eff as messages (P + O + R), or P + R without ``old``."""
        return list(self.prefix) + (flatten(self.old) if old else []) + flatten(self.recent)


def context_view(conversation: Conversation, memories: Sequence[Memory] = (), retained_blocks: int = 2) -> ContextView:
    """C_eff of ``conversation`` under ``memories``, split into P / O / R."""
    covered = {block_id for m in memories for block_id in m.covered_block_ids}
    live = [b for b in conversation.blocks if b.block_id not in covered]
    old, recent = split_recent(live, retained_blocks)
    return ContextView(tuple(conversation.prefix), old, recent, covered=len(conversation.blocks) - len(live))
