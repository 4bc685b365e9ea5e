"""Hands out KV cache blocks to sequences; a block holds ``block_size`` tokens' k/v."""

from __future__ import annotations

from collections import deque

from omnistage.stage.ar.sequence import Sequence


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_free_blocks >= self.num_blocks_for(seq.num_tokens)

    def allocate(self, seq: Sequence) -> None:
        """Give ``seq`` blocks for all its tokens (a prefill writes them all)."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id} already holds blocks")
        seq.block_table = [
            self.free_block_ids.popleft() for _ in range(self.num_blocks_for(seq.num_tokens))
        ]

    def free(self, seq: Sequence) -> None:
        self.free_block_ids.extend(seq.block_table)
        seq.block_table = []

    def can_append(self, seq: Sequence) -> bool:
        """Whether the next decode (which writes the k/v of the last token) fits."""
        return self._needs_block(seq) <= self.num_free_blocks

    def may_append(self, seq: Sequence) -> None:
        if self._needs_block(seq):
            seq.block_table.append(self.free_block_ids.popleft())

    def _needs_block(self, seq: Sequence) -> int:
        return int(len(seq.block_table) * self.block_size < seq.num_tokens)

    def reset(self) -> None:
        """Every block free again (after the KV cache was discarded)."""
        self.free_block_ids = deque(range(self.num_blocks))
