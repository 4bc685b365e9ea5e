"""Hands out KV cache blocks to sequences, and reuses computed blocks across them (automatic
prefix caching, as vLLM's): a block holds ``block_size`` tokens' k/v.

A full block whose k/v have been computed is registered under a digest chained over every
token before it (BLAKE2b of the previous block's digest and its tokens — and of the content
hashes of the multimodal items with placeholders in it, so one picture's k/v never serve
another's: a request cannot be crafted to collide with another's prefix), so two sequences
that start with the same tokens share those blocks: a new sequence's prefill skips the blocks found and
computes the rest. Blocks are reference-counted; a block no sequence holds goes to the free
list but stays findable until it is handed out again (least recently freed first), which is
when it is evicted. ``clear_cache`` forgets every registration: whenever the weights change
or the KV cache is released, no stale prefix can be served.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

from omnistage.stage.ar.multi_modal import cache_keys
from omnistage.stage.ar.sequence import SequenceState


@dataclass
class PrefixCacheStats:
    """Counted in tokens, over prompts that could use the cache."""

    queried_tokens: int = 0
    hit_tokens: int = 0
    resets: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


def block_hashes(
    token_ids: list[int], block_size: int, num_blocks: int, extra: list[bytes] | None = None
) -> list[bytes]:
    """The chained digests of the first ``num_blocks`` full blocks of ``token_ids``; ``extra``
    (per block) is what else decides a block's k/v (its multimodal items)."""
    hashes, parent = [], b""
    for i in range(num_blocks):
        tokens = array("q", token_ids[i * block_size : (i + 1) * block_size]).tobytes()
        key = parent + tokens + (b"|" + extra[i] if extra else b"")
        parent = hashlib.blake2b(key, digest_size=16).digest()
        hashes.append(parent)
    return hashes


def sequence_hashes(seq: SequenceState, block_size: int, num_blocks: int) -> list[bytes]:
    extra = cache_keys(seq.multi_modal, block_size, num_blocks) if seq.multi_modal else None
    return block_hashes(seq.token_ids, block_size, num_blocks, extra)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # digest -> block holding those (computed) tokens
        # Blocks nobody holds, least recently freed first: the next to be handed out.
        self.free_block_ids: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.stats = PrefixCacheStats()

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_block_ids)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached)

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    # -- allocation --------------------------------------------------------------------

    def _prefix_hits(self, seq: SequenceState) -> list[int]:
        """Cached blocks that hold the start of ``seq``'s tokens, in order. The last token is
        never taken from the cache: its logits must be computed."""
        if not (self.enable_prefix_caching and seq.may_use_prefix_cache):
            return []
        num_full = (seq.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in sequence_hashes(seq, self.block_size, num_full):
            block = self.cached.get(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def can_allocate(self, seq: SequenceState, extra_blocks: int = 0) -> bool:
        hits = self._prefix_hits(seq)
        fresh = self.num_blocks_for(seq.num_tokens) - len(hits) + extra_blocks
        return self.num_free_blocks - sum(self.ref_counts[b] == 0 for b in hits) >= fresh

    def allocate(self, seq: SequenceState) -> None:
        """Give ``seq`` blocks for all its tokens: the cached ones its prefix matches (their
        tokens need no computing: ``seq.num_cached_tokens``), then fresh ones."""
        if seq.block_table:
            raise RuntimeError(f"sequence {seq.request_id} already holds blocks")
        hits = self._prefix_hits(seq)
        for block in hits:
            self._hold(block)
        if self.enable_prefix_caching and seq.may_use_prefix_cache:
            self.stats.queried_tokens += seq.num_tokens
            self.stats.hit_tokens += len(hits) * self.block_size
        seq.block_table = hits + [
            self._take_free_block() for _ in range(self.num_blocks_for(seq.num_tokens) - len(hits))
        ]
        seq.num_cached_tokens = len(hits) * self.block_size
        seq.num_hashed_blocks = len(hits)
        if seq.num_prompt_cached_tokens is None:
            seq.num_prompt_cached_tokens = seq.num_cached_tokens

    def share(self, parent: SequenceState, child: SequenceState, copy_block: int | None) -> None:
        """Give ``child`` (a fork of ``parent`` after its prefill) the parent's blocks; the
        last, partly filled one is replaced by ``copy_block``, which the caller fills with a
        copy of it (the two sequences write different tokens there next)."""
        table = list(parent.block_table)
        if copy_block is not None:
            table[-1] = copy_block
        for block in table:
            if block != copy_block:
                self._hold(block)
        child.block_table = table
        child.num_cached_tokens = parent.num_tokens - 1
        child.num_prompt_cached_tokens = parent.num_prompt_cached_tokens
        child.num_hashed_blocks = parent.num_hashed_blocks

    def take_block(self) -> int:
        """A fresh block for the caller to hold (``share``'s copy)."""
        return self._take_free_block()

    def _hold(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_block_ids[block]
        self.ref_counts[block] += 1

    def _take_free_block(self) -> int:
        block, _ = self.free_block_ids.popitem(last=False)
        old_hash = self.block_hash[block]
        if old_hash is not None:  # evicted: its tokens are no longer findable
            if self.cached.get(old_hash) == block:
                del self.cached[old_hash]
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def free(self, seq: SequenceState) -> None:
        # Tail blocks first, so that they are the first evicted: a prefix outlives its tails.
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_block_ids[block] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def computing(self, seq: SequenceState) -> set[bytes]:
        """Digests of the full blocks ``seq``'s coming prefill computes (just allocated, not
        cached): what a sequence that starts alike finds cached once that prefill ran."""
        if not (self.enable_prefix_caching and seq.may_use_prefix_cache):
            return set()
        num_full = (seq.num_tokens - 1) // self.block_size
        return set(sequence_hashes(seq, self.block_size, num_full)[seq.num_hashed_blocks :])

    def waits_for(self, seq: SequenceState, computing: set[bytes]) -> bool:
        """Whether ``seq``'s first block not cached is among ``computing``: prefilled a step
        later, it computes none of the blocks another prefill of this step computes."""
        if not (computing and self.enable_prefix_caching and seq.may_use_prefix_cache):
            return False
        num_full = (seq.num_tokens - 1) // self.block_size
        for block_hash in sequence_hashes(seq, self.block_size, num_full):
            if block_hash not in self.cached:
                return block_hash in computing
        return False

    # -- decode ------------------------------------------------------------------------

    def can_append(self, seq: SequenceState) -> bool:
        """Whether the next decode (which writes the k/v of the last token) fits."""
        return self._needs_block(seq) <= self.num_free_blocks

    def may_append(self, seq: SequenceState) -> None:
        if self._needs_block(seq):
            seq.block_table.append(self._take_free_block())

    def _needs_block(self, seq: SequenceState) -> int:
        return int(len(seq.block_table) * self.block_size < seq.num_tokens)

    # -- registration ------------------------------------------------------------------

    def cache_computed_blocks(self, seq: SequenceState) -> None:
        """Register ``seq``'s full blocks whose k/v are computed (every token but the last:
        its k/v are written by the next step)."""
        if not (self.enable_prefix_caching and seq.kv_keyed_by_tokens):
            return
        num_full = (seq.num_tokens - 1) // self.block_size
        if num_full <= seq.num_hashed_blocks:
            return
        hashes = sequence_hashes(seq, self.block_size, num_full)
        for i in range(seq.num_hashed_blocks, num_full):
            block = seq.block_table[i]
            if self.block_hash[block] is None and hashes[i] not in self.cached:
                self.block_hash[block] = hashes[i]
                self.cached[hashes[i]] = block
        seq.num_hashed_blocks = num_full

    def clear_cache(self) -> None:
        """Forget every registered block (the weights changed): nothing is reused again."""
        self.cached.clear()
        self.block_hash = [None] * self.num_blocks
        self.stats.resets += 1

    def reset(self) -> None:
        """Every block free and forgotten (after the KV cache was discarded)."""
        self.ref_counts = [0] * self.num_blocks
        self.free_block_ids = OrderedDict.fromkeys(range(self.num_blocks))
        self.clear_cache()

    def cache_status(self) -> dict[str, object]:
        """The prefix cache as ``status()`` reports it."""
        return {
            "enabled": self.enable_prefix_caching,
            "cached_blocks": self.num_cached_blocks,
            "queried_tokens": self.stats.queried_tokens,
            "hit_tokens": self.stats.hit_tokens,
            "hit_rate": self.stats.hit_rate,
            "resets": self.stats.resets,
        }
