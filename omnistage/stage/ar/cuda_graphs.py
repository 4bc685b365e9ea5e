"""Decode CUDA graphs for a ladder of batch sizes.

Captured once after the KV cache exists. The graphs read the weights and the KV cache at
their arena addresses, which survive sleep and wake, so they are replayed after a wake
without recapture. Padded rows of a batch write their k/v into the cache's scratch slot.
"""

from __future__ import annotations

import torch

from omnistage.models.attention import AttentionBackend, AttentionMetadata, KVCacheLayer
from omnistage.models.decoder import CausalLM


def batch_size_ladder(max_num_seqs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        backend: AttentionBackend,
        kv_caches: list[KVCacheLayer],
        max_num_seqs: int,
        max_blocks_per_seq: int,
        scratch_slot: int,
        device: torch.device,
    ) -> None:
        self.model = model
        self.backend = backend  # one that allows graph capture
        self.kv_caches = kv_caches
        self.scratch_slot = scratch_slot
        self.batch_sizes = batch_size_ladder(max_num_seqs)
        self.input_ids = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.positions = torch.zeros(max_num_seqs, dtype=torch.long, device=device)
        self.slot_mapping = torch.full(
            (max_num_seqs,), scratch_slot, dtype=torch.long, device=device
        )
        self.context_lens = torch.ones(max_num_seqs, dtype=torch.long, device=device)
        self.block_tables = torch.zeros(
            max_num_seqs, max_blocks_per_seq, dtype=torch.long, device=device
        )
        self.hidden = torch.zeros(
            max_num_seqs, model.config.hidden_size, dtype=model.lm_head.weight.dtype, device=device
        )
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def _context(self, batch: int) -> AttentionMetadata:
        return self.backend.decode(
            self.slot_mapping[:batch], self.block_tables[:batch], self.context_lens[:batch]
        )

    @torch.no_grad()
    def capture(self) -> None:
        pool = None
        for batch in reversed(self.batch_sizes):  # largest first: the pool then fits all
            args = (self.input_ids[:batch], self.positions[:batch], self._context(batch))
            self.hidden[:batch] = self.model(*args, self.kv_caches)  # warm-up outside capture
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.hidden[:batch] = self.model(*args, self.kv_caches)
            pool = graph.pool()
            self.graphs[batch] = graph
        torch.cuda.synchronize()

    def can_run(self, batch: int, num_blocks: int) -> bool:
        return (
            bool(self.graphs)
            and batch <= self.batch_sizes[-1]
            and num_blocks <= self.block_tables.shape[1]
        )

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        context_lens: torch.Tensor,
        block_tables: torch.Tensor,
    ) -> torch.Tensor:
        """Hidden states ``[B, hidden]`` of one decode step, by replaying a captured graph."""
        batch = input_ids.shape[0]
        padded = next(b for b in self.batch_sizes if b >= batch)
        self.input_ids[:batch] = input_ids
        self.positions[:batch] = positions
        self.slot_mapping[:padded] = self.scratch_slot
        self.slot_mapping[:batch] = slot_mapping
        self.context_lens[:padded] = 1
        self.context_lens[:batch] = context_lens
        self.block_tables[:padded] = 0
        self.block_tables[:batch, : block_tables.shape[1]] = block_tables
        self.graphs[padded].replay()
        return self.hidden[:batch]
