"""Owns the model and its KV cache on one device; turns scheduled sequences into logits.

The model is built on ``meta``, adopted into the arena (tag ``weights``) and filled by the
loader; the KV cache is allocated once in the arena (tag ``kv_cache``). Both keep their
addresses across sleep and wake, which is what lets captured decode graphs be replayed.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from omnistage.config import StageConfig
from omnistage.memory import Arena
from omnistage.models import registry
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.attention import select_backend
from omnistage.models.loader import LoadReport, load_into, module_targets
from omnistage.models.tensor_parallel import SINGLE, Shard, TPGroup, rank_heads, shards_of
from omnistage.stage.ar.cuda_graphs import DecodeGraphs
from omnistage.stage.ar.kv_cache import KVCache, plan_kv_cache, resolved_max_model_len
from omnistage.stage.ar.multi_modal import EncoderCache
from omnistage.stage.ar.sequence import SequenceState
from omnistage.stage.resolve import resolve_dtype

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class StepResult:
    """Logits of each sequence's last token and, for those that asked, hidden-state rows and
    the logits of every prompt position (prompt logprobs)."""

    logits: torch.Tensor
    hidden_states: dict[int, torch.Tensor]  # index into the scheduled list -> [rows, hidden]
    prompt_logits: dict[int, torch.Tensor] = field(default_factory=dict)
    # Each sequence's last final hidden state, for a multi-codebook model's frame prediction.
    last_hidden: torch.Tensor | None = None


class ModelRunner:
    def __init__(
        self,
        config: StageConfig,
        model_config: ARModelConfig,
        arena: Arena,
        *,
        load_weights: bool = True,
        tp: TPGroup = SINGLE,
    ) -> None:
        self.config = config
        self.model_config = model_config
        self.tp = tp
        self.device = torch.device(config.device)
        self.dtype = DTYPES[resolve_dtype(config, model_config.torch_dtype)]
        self.block_size = config.ar.block_size
        self.family = registry.ar_family(model_config.family)
        self.model = self.family.build_decoder(model_config, self.dtype, tp)
        self.attention = select_backend(self.device, config.ar.attention_backend)
        self.weight_bytes = arena.adopt(self.model, tag="weights")
        self.arena = arena
        # what the model runs beside its decoder, under its own tags (a Base talker's encoders)
        self.model.adopt_components(arena, Path(config.model), load=load_weights)
        self.encoder_cache = EncoderCache(config.ar.encoder_cache_mb << 20)
        self._layer_out: torch.Tensor | None = None  # a kept layer's output (``run``)
        self.model.model.rotary_emb.to(self.device)  # derived buffers stay outside the arena
        if load_weights:  # not for a restart asleep at level 2: released at once, unread
            self.load_weights(Path(config.model), strict=True)
        # A rank caches the k/v of its own kv heads only.
        heads, kv_heads = rank_heads(
            model_config.num_attention_heads, model_config.num_key_value_heads, tp
        )
        rank_config = dataclasses.replace(
            model_config, num_attention_heads=heads, num_key_value_heads=kv_heads
        )
        self.kv_cache = KVCache(
            arena,
            rank_config,
            plan_kv_cache(config, rank_config, self.dtype, self.device),
            self.dtype,
            self.attention,
        )
        self.max_blocks_per_seq = -(-resolved_max_model_len(config) // config.ar.block_size)
        self.decode_graphs: DecodeGraphs | None = None
        # Decode graphs are captured with one rank only (a graph would hold the collectives),
        # and only where the attention backend allows it and the stage does not enforce eager.
        graphs = self.attention.supports_cuda_graphs and not config.ar.enforce_eager
        if self.device.type == "cuda" and tp.size == 1 and graphs:
            self.decode_graphs = DecodeGraphs(
                self.model,
                self.attention,
                self.kv_cache.layers,
                config.ar.max_num_seqs,
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

    def copy_kv_block(self, src: int, dst: int) -> None:
        """Copy one block's k/v of every layer (a forked sample's own copy of a shared block)."""
        self.kv_cache.copy_block(src, dst)

    @functools.cached_property
    def _load_targets(self) -> tuple[dict[str, torch.Tensor], dict[str, Shard] | None]:
        """The weights by checkpoint name and this rank's slices of them: fixed for the
        model's life (the arena keeps every address), so a reload does not walk it again."""
        return module_targets(self.model), shards_of(self.model) or None

    def load_weights(self, path: Path, strict: bool, check_finite: bool = False) -> LoadReport:
        """Copy a checkpoint (folder or safetensors file) into the weights, in place."""
        self.encoder_cache.clear()  # its outputs came from the old weights
        rename: Callable[[str], str | None] = self.family.rename(self.model_config.part)
        targets, shards = self._load_targets
        report = load_into(
            targets, path, rename=rename, strict=strict, check_finite=check_finite, shards=shards
        )
        tags = self.model.component_tags
        if tags:  # only awake ones; while some is invalid (a level-2 wake), only those
            awake = [t for t in tags if not self.arena.is_asleep(t)]
            invalid = [t for t in awake if not self.arena.is_valid(t)]
            report.num_bytes += self.model.load_components(path, invalid or awake)
        return report

    def _tensor(self, values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long, device=self.device)

    def _slots(self, seq: SequenceState, start: int, end: int) -> list[int]:
        size = self.block_size
        return [seq.block_table[p // size] * size + p % size for p in range(start, end)]

    def embed_tokens(self, token_ids: list[int]) -> torch.Tensor:
        """The input embeddings of ``token_ids`` (``[k, embedding_size]``, on the CPU)."""
        with torch.no_grad():
            return self.model.embed(self._tensor(token_ids)).float().cpu()

    def _inputs_embeds(
        self, seq: SequenceState, start: int, token_embeds: torch.Tensor
    ) -> torch.Tensor:
        """The model inputs of ``seq``'s positions ``start, start + 1, ...`` (one per row of
        ``token_embeds``, their tokens' embeddings): its prompt embeddings (projected by the
        model), plus the tokens' own from ``token_embeds_from`` on; after the prompt, the
        tokens' (or their whole frame's, ``frame_embeds``) plus the decode embedding of that
        step (the last row repeating)."""
        out = token_embeds.clone()
        end = start + len(out)
        prompt_len = seq.num_prompt_tokens
        if seq.prompt_embeds is not None and start < prompt_len:
            stop = min(end, prompt_len)
            own = self.model.project_embeds(seq.prompt_embeds[start:stop])
            keep_from = seq.token_embeds_from if seq.token_embeds_from is not None else stop
            token_part = torch.arange(start, stop, device=out.device) >= keep_from
            rows = out[: stop - start]
            out[: stop - start] = own + rows * token_part.unsqueeze(1).to(rows.dtype)
        if end <= prompt_len:
            return out
        first = max(start, prompt_len)
        steps = torch.arange(first - prompt_len, end - prompt_len, device=out.device)
        if seq.frame_embeds:
            out[first - start :] = torch.stack([seq.frame_embeds[t] for t in steps.tolist()])
        if seq.decode_embeds is not None:
            steps = steps.clamp(max=len(seq.decode_embeds) - 1)
            out[first - start :] += self.model.project_embeds(seq.decode_embeds[steps])
        return out

    def _positions(self, seq: SequenceState, start: int) -> torch.Tensor:
        """Positions of ``seq``'s tokens from ``start`` on: ``[T]``, or ``[3, T]`` (time,
        height, width) for a prompt with multimodal rotary positions; a generated token
        (recomputed after a preemption) sits at its index plus ``position_delta``."""
        if seq.positions is None:
            return torch.arange(start, seq.num_tokens, device=self.device)
        prompt = seq.positions[:, start:]
        first = max(start, seq.num_prompt_tokens)
        later = torch.arange(first, seq.num_tokens, device=self.device) + seq.position_delta
        return torch.cat([prompt.to(self.device), later.expand(3, -1)], dim=1)

    def _encode_multi_modal(
        self, seq: SequenceState, rows: torch.Tensor
    ) -> list[tuple[int, torch.Tensor]]:
        """The encoder step: each multimodal item's embeddings replace those of its
        placeholder positions among ``rows`` (``seq``'s positions from ``num_cached_tokens``
        on; an item's positions before that came from the prefix cache). An encoder output
        ``[1 + k, length, hidden]`` also brings rows the decoder adds after its first k
        layers: returned as (first row, ``[k, n, hidden]``)."""
        start = seq.num_cached_tokens
        layer_rows = []
        for item in seq.multi_modal:
            lo, hi = max(item.offset, start), item.offset + item.length
            if lo >= hi:
                continue
            encoded = self.encoder_cache.encode(self.model, item).to(rows.dtype)
            if encoded.dim() == 3:
                layer_rows.append((lo - start, encoded[1:, lo - item.offset : hi - item.offset]))
                encoded = encoded[0]
            rows[lo - start : hi - start] = encoded[lo - item.offset : hi - item.offset]
        return layer_rows

    def _hidden_rows(
        self,
        seq: SequenceState,
        hidden: torch.Tensor,
        embeds: torch.Tensor | None,
        start: int,
        end: int,
    ) -> torch.Tensor:
        rows = hidden[start:end]
        if seq.hidden_layer is not None:  # that layer's output, the embedding beside it
            assert self._layer_out is not None
            rows = self._layer_out[start:end]
        if not seq.hidden_states_with_embeddings or embeds is None:
            return rows.clone()
        added = embeds[start:end]
        if seq.text_embeddings_only and seq.multi_modal:  # no encoder output added
            added = added.clone()
            first = seq.num_cached_tokens  # the position of row ``start``
            for item in seq.multi_modal:
                lo = max(item.offset - first, 0)
                hi = min(item.offset + item.length - first, end - start)
                if lo < hi:
                    added[lo:hi] = 0
        if seq.hidden_layer is not None:
            return torch.cat([added, rows], dim=-1)
        return rows + added

    @torch.no_grad()
    def run(self, seqs: list[SequenceState], is_prefill: bool) -> StepResult:
        layer = next((s.hidden_layer for s in seqs if s.hidden_layer is not None), None)
        if layer is None:
            return self._prefill(seqs) if is_prefill else self._decode(seqs)
        if not 1 <= layer <= len(self.model.model.layers):
            raise ValueError(f"hidden_layer {layer} is not a decoder layer of this model")
        # One layer's output besides the final one: a hook keeps it for ``_hidden_rows``.
        kept = self.model.model.layers[layer - 1].register_forward_hook(self._keep_layer)
        try:
            return self._prefill(seqs) if is_prefill else self._decode(seqs)
        finally:
            kept.remove()
            self._layer_out = None

    def _keep_layer(self, module: object, args: object, output: torch.Tensor) -> None:
        self._layer_out = output

    def _prefill(self, seqs: list[SequenceState]) -> StepResult:
        """Compute each sequence's tokens from ``num_cached_tokens`` on (the ones before came
        from the prefix cache)."""
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[int] = []
        cu_seqlens = [0]
        for seq in seqs:
            start = seq.num_cached_tokens
            input_ids += seq.token_ids[start:]
            positions.append(self._positions(seq, start))
            slots += self._slots(seq, start, seq.num_tokens)
            cu_seqlens.append(cu_seqlens[-1] + seq.num_tokens - start)
        prefix_lens = [seq.num_cached_tokens for seq in seqs]
        metadata = self.attention.prefill(
            self._tensor(slots),
            cu_seqlens,
            prefix_lens,
            [self._tensor(seq.block_table) for seq in seqs] if any(prefix_lens) else None,
        )
        ids = self._tensor(input_ids)
        embeds = None
        added: list[tuple[int, torch.Tensor]] = []  # rows added after the first layers
        if any(
            s.has_input_embeds or s.hidden_states_with_embeddings or s.multi_modal for s in seqs
        ):
            embeds = self.model.embed(ids)
            for i, seq in enumerate(seqs):
                rows = slice(cu_seqlens[i], cu_seqlens[i + 1])
                if seq.has_input_embeds:
                    embeds[rows] = self._inputs_embeds(seq, seq.num_cached_tokens, embeds[rows])
                if seq.multi_modal:
                    added += [
                        (cu_seqlens[i] + at, r)
                        for at, r in self._encode_multi_modal(seq, embeds[rows])
                    ]
        extra = {"layer_rows": _layer_rows(added, self.device)} if added else {}
        hidden = self.model(
            ids, _joined(positions), metadata, self.kv_cache.layers, embeds, **extra
        )
        last_rows = hidden[self._tensor([end - 1 for end in cu_seqlens[1:]])]
        wanted = {
            i: self._hidden_rows(seq, hidden, embeds, cu_seqlens[i], cu_seqlens[i + 1])
            for i, seq in enumerate(seqs)
            if seq.return_hidden_states
        }
        prompt_logits = {
            i: self.model.compute_logits(hidden[cu_seqlens[i] : cu_seqlens[i + 1] - 1])
            for i, seq in enumerate(seqs)
            if seq.params.prompt_logprobs is not None and seq.prompt_logprobs is None
        }
        return StepResult(
            self.model.compute_logits(last_rows), wanted, prompt_logits, self._framed(last_rows)
        )

    def _decode(self, seqs: list[SequenceState]) -> StepResult:
        input_ids = self._tensor([seq.last_token_id for seq in seqs])
        positions = self._tensor([seq.num_tokens - 1 + seq.position_delta for seq in seqs])
        slots = self._tensor(
            [self._slots(seq, seq.num_tokens - 1, seq.num_tokens)[0] for seq in seqs]
        )
        context_lens = self._tensor([seq.num_tokens for seq in seqs])
        width = max(len(seq.block_table) for seq in seqs)
        block_tables = self._tensor(
            [b for seq in seqs for b in seq.block_table + [0] * (width - len(seq.block_table))]
        ).view(len(seqs), width)
        embeds = None
        if any(seq.has_input_embeds or seq.hidden_states_with_embeddings for seq in seqs):
            embeds = self.model.embed(input_ids)  # the graphs take ids: these run eagerly
            for i, seq in enumerate(seqs):
                if seq.has_input_embeds:
                    embeds[i : i + 1] = self._inputs_embeds(
                        seq, seq.num_tokens - 1, embeds[i : i + 1]
                    )
        graphs = self.decode_graphs
        if embeds is None and graphs is not None and graphs.can_run(len(seqs), width):
            hidden = graphs.run(input_ids, positions, slots, context_lens, block_tables)
        else:
            metadata = self.attention.decode(slots, block_tables, context_lens)
            hidden = self.model(input_ids, positions, metadata, self.kv_cache.layers, embeds)
        wanted = {
            i: self._hidden_rows(seq, hidden, embeds, i, i + 1)
            for i, seq in enumerate(seqs)
            if seq.return_hidden_states
        }
        return StepResult(self.model.compute_logits(hidden), wanted, {}, self._framed(hidden))

    def _framed(self, last_rows: torch.Tensor) -> torch.Tensor | None:
        return last_rows if self.model_config.code_groups > 1 else None

    @torch.no_grad()
    def predict_frames(
        self,
        last_hidden: torch.Tensor,
        token_ids: list[int],
        seqs: list[SequenceState],
        generators: list[torch.Generator],
    ) -> list[list[int]]:
        """A multi-codebook model's step, after its first codes (``token_ids``) were sampled:
        each sequence's other codes, predicted by the model from its last hidden state
        (greedy for a greedy request, else drawn from ``generators``); the whole frame's
        input embedding goes to ``seq.frame_embeds`` for the next step."""
        codes, embeds = self.model.predict_frame(  # type: ignore[operator]
            last_hidden, self._tensor(token_ids), [s.params for s in seqs], generators
        )
        for seq, row in zip(seqs, embeds, strict=True):
            seq.frame_embeds.append(row)
        return [list(map(int, c)) for c in codes.tolist()]


def _layer_rows(
    added: list[tuple[int, torch.Tensor]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The decoder's ``layer_rows`` (token indices ``[N]``, rows ``[k, N, hidden]``) of
    per-item (first token, ``[k_i, n_i, hidden]``); an item with fewer layers adds zeros."""
    k = max(len(rows) for _, rows in added)
    at = torch.cat([torch.arange(first, first + rows.shape[1]) for first, rows in added])
    padded = [torch.cat([r, r.new_zeros(k - len(r), *r.shape[1:])]) for _, r in added]
    return at.to(device), torch.cat(padded, dim=1)


def _joined(positions: list[torch.Tensor]) -> torch.Tensor:
    """One batch's positions: ``[T]``, or ``[3, T]`` when any sequence has multimodal ones
    (a plain sequence's positions then fill all three rows, which is its ordinary RoPE)."""
    if all(p.dim() == 1 for p in positions):
        return torch.cat(positions)
    return torch.cat([p.expand(3, -1) if p.dim() == 1 else p for p in positions], dim=1)
