"""Owns the model and its KV cache on one device; turns scheduled sequences into logits.

The model is built on ``meta``, adopted into the arena (tag ``weights``) and filled by the
loader; the KV cache is allocated once in the arena (tag ``kv_cache``). Both keep their
addresses across sleep and wake, which is what lets captured decode graphs be replayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from omnistage.config import StageConfig
from omnistage.memory import Arena
from omnistage.models.ar_attention import AttentionContext
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.loader import LoadReport, load_module
from omnistage.models.qwen2 import Qwen2ForCausalLM, checkpoint_rename
from omnistage.stage.ar.cuda_graphs import DecodeGraphs
from omnistage.stage.ar.kv_cache import KVCache, plan_kv_cache
from omnistage.stage.ar.sequence import Sequence

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class StepResult:
    """Logits of each sequence's last token and, for those that asked, hidden-state rows."""

    logits: torch.Tensor
    hidden_states: dict[int, torch.Tensor]  # index into the scheduled list -> [rows, hidden]


class ModelRunner:
    def __init__(
        self,
        config: StageConfig,
        model_config: ARModelConfig,
        arena: Arena,
        *,
        load_weights: bool = True,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.device = torch.device(config.device)
        self.dtype = DTYPES[config.dtype]
        self.block_size = config.block_size
        self.model = Qwen2ForCausalLM.on_meta(model_config, self.dtype)
        self.weight_bytes = arena.adopt(self.model, tag="weights")
        self.model.model.rotary_emb.to(self.device)  # derived buffers stay outside the arena
        if load_weights:  # not for a restart asleep at level 2: released at once, unread
            self.load_weights(Path(config.model), strict=True)
        self.kv_cache = KVCache(
            arena,
            model_config,
            plan_kv_cache(config, model_config, self.dtype, self.device),
            self.dtype,
        )
        self.max_blocks_per_seq = -(-config.max_model_len // config.block_size)
        self.decode_graphs: DecodeGraphs | None = None
        if self.device.type == "cuda":
            self.decode_graphs = DecodeGraphs(
                self.model,
                self.kv_cache.layers,
                config.max_num_seqs,
                self.max_blocks_per_seq,
                self.kv_cache.scratch_slot,
                self.device,
            )
            self.decode_graphs.capture()

    @property
    def num_kv_blocks(self) -> int:
        return self.kv_cache.plan.num_blocks

    @property
    def has_cuda_graphs(self) -> bool:
        return self.decode_graphs is not None and bool(self.decode_graphs.graphs)

    def load_weights(self, path: Path, strict: bool, check_finite: bool = False) -> LoadReport:
        """Copy a checkpoint (folder or safetensors file) into the weights, in place."""
        return load_module(
            self.model, path, rename=checkpoint_rename, strict=strict, check_finite=check_finite
        )

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _slots(self, seq: Sequence, start: int, end: int) -> list[int]:
        size = self.block_size
        return [seq.block_table[p // size] * size + p % size for p in range(start, end)]

    @torch.no_grad()
    def run(self, seqs: list[Sequence], is_prefill: bool) -> StepResult:
        return self._prefill(seqs) if is_prefill else self._decode(seqs)

    def _prefill(self, seqs: list[Sequence]) -> StepResult:
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        cu_seqlens = [0]
        for seq in seqs:
            input_ids += seq.token_ids
            positions += range(seq.num_tokens)
            slots += self._slots(seq, 0, seq.num_tokens)
            cu_seqlens.append(cu_seqlens[-1] + seq.num_tokens)
        context = AttentionContext(
            is_prefill=True, slot_mapping=self._tensor(slots), cu_seqlens=cu_seqlens
        )
        hidden = self.model(
            self._tensor(input_ids), self._tensor(positions), context, self.kv_cache.layers
        )
        last_rows = hidden[self._tensor([end - 1 for end in cu_seqlens[1:]])]
        wanted = {
            i: hidden[cu_seqlens[i] : cu_seqlens[i + 1]].clone()
            for i, seq in enumerate(seqs)
            if seq.return_hidden_states
        }
        return StepResult(self.model.compute_logits(last_rows), wanted)

    def _decode(self, seqs: list[Sequence]) -> StepResult:
        input_ids = self._tensor([seq.last_token_id for seq in seqs])
        positions = self._tensor([seq.num_tokens - 1 for seq in seqs])
        slots = self._tensor(
            [self._slots(seq, seq.num_tokens - 1, seq.num_tokens)[0] for seq in seqs]
        )
        context_lens = self._tensor([seq.num_tokens for seq in seqs])
        width = max(len(seq.block_table) for seq in seqs)
        block_tables = self._tensor(
            [b for seq in seqs for b in seq.block_table + [0] * (width - len(seq.block_table))]
        ).view(len(seqs), width)
        if self.decode_graphs is not None and self.decode_graphs.can_run(len(seqs), width):
            hidden = self.decode_graphs.run(input_ids, positions, slots, context_lens, block_tables)
        else:
            context = AttentionContext(
                is_prefill=False,
                slot_mapping=slots,
                block_tables=block_tables,
                context_lens=context_lens,
            )
            hidden = self.model(input_ids, positions, context, self.kv_cache.layers)
        wanted = {
            i: hidden[i : i + 1].clone() for i, seq in enumerate(seqs) if seq.return_hidden_states
        }
        return StepResult(self.model.compute_logits(hidden), wanted)
