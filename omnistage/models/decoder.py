"""The decoder every registered decoder family runs (Qwen2/Qwen2.5, Qwen3, Qwen3-MoE, Llama,
the Qwen2.5-Omni thinker and talker), over a paged KV cache.

Its shape comes from ``ARModelConfig`` (which the family's mapping fills): biases, per-head
q/k norms, and per layer a dense MLP or experts (``uses_experts``); how it splits over
tensor-parallel ranks from the family's ``TPPlan``. Parameter names follow the HF checkpoints
(``model.layers.0.self_attn.q_proj.weight``...), so the loader fills the model without
renaming. The forward pass takes a flat batch of tokens (``input_ids`` and ``positions`` of
shape ``[T]``) and returns the final hidden states (after the last norm); ``compute_logits``
turns the rows it is given into vocabulary logits. Attention goes through the stage's attention
backend (``omnistage.models.attention``). Numerics follow transformers (RMSNorm in fp32,
rotary tables computed per call in fp32, expert routing as its sparse MoE block).

On the CPU a token's hidden state does not depend on the other tokens of the batch, bit for bit
(see ``omnistage/batch_invariance.py``): GEMM rows are made invariant by MKL's strict CNR mode
and ``invariant_linear``'s padding, attention by the ``torch_sdpa`` backend, and silu, which
rounds differently on its SIMD and scalar paths, runs through ``rowwise``. (cos, sin and exp
take the SIMD path for every element already.) Experts are the exception: a token's experts
run on the rows routed to them, so their GEMMs see other tokens.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from omnistage.errors import CheckpointError
from omnistage.models.ar_config import ARModelConfig, RopeConfig
from omnistage.models.attention import AttentionMetadata, KVCacheLayer, causal_attention
from omnistage.models.decoder_hooks import PartHooks
from omnistage.models.meta import no_weight_init
from omnistage.models.tensor_parallel import (
    REPLICATED,
    SINGLE,
    ColumnParallelLinear,
    RowParallelLinear,
    TPGroup,
    VocabParallelEmbedding,
    VocabParallelLMHead,
    even_split,
    kv_head_split,
    parallel_linear,
)

# ATen runs an elementwise CPU op on one thread below this many elements
# (at::internal::GRAIN_SIZE).
_GRAIN_SIZE = 32768
# Elements per step of ATen's SIMD loop: two vectors (32 fp32 with AVX-512; 64 also covers
# two AVX-512 vectors of bf16/fp16).
_SIMD_STEP = 64


@functools.lru_cache(maxsize=4096)
def rowwise_rows(rows: int, row_numel: int, threads: int) -> int:
    """Rows (>= ``rows``) to run an elementwise CPU op on so that every element takes the SIMD
    path, whatever the number of rows.

    ATen splits an elementwise op into one contiguous chunk per thread (``divup(numel, n)``
    elements for ``n = min(threads, divup(numel, GRAIN_SIZE))`` threads) and runs each chunk
    in SIMD steps; the chunk's last partial step takes the scalar function, which for some
    functions (silu: ``std::exp`` against Sleef's exp) rounds differently from the SIMD one.
    Where chunks end depends on the total size, so a token's row would differ in the last bits
    with the rest of the batch, unless the rows are padded until every chunk is a whole number
    of steps.
    """
    padded = rows
    while True:
        numel = padded * row_numel
        chunks = (
            1 if threads == 1 or numel < _GRAIN_SIZE else min(threads, -(-numel // _GRAIN_SIZE))
        )
        if numel % (_SIMD_STEP * chunks) == 0:
            return padded
        padded += 1


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """``fn(x)`` for an elementwise ``fn`` and a contiguous ``x`` whose first dim is tokens, each
    row computed alike however many rows there are (see ``rowwise_rows``; CPU only)."""
    if x.device.type != "cpu" or x.dim() == 0 or x.numel() == 0:
        return fn(x)
    rows = x.shape[0]
    padded = rowwise_rows(rows, x.numel() // rows, torch.get_num_threads())
    if padded == rows:
        return fn(x)
    pad = x.new_zeros(padded - rows, *x.shape[1:])
    return fn(torch.cat((x, pad)))[:rows]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        input_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(input_dtype)


def rope_inverse_frequencies(head_dim: int, rope: RopeConfig) -> torch.Tensor:
    """fp32 inverse frequencies on the CPU (explicitly: models are built under ``meta``)."""
    steps = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float()
    inv_freq = 1.0 / (rope.theta ** (steps / head_dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        low_wavelen = rope.original_max_position_embeddings / rope.low_freq_factor
        high_wavelen = rope.original_max_position_embeddings / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (rope.original_max_position_embeddings / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor
        )
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, scaled)
    return inv_freq


class RotaryEmbedding(nn.Module):
    """Rotary cos/sin tables for given positions; derived data, not part of the checkpoint."""

    def __init__(self, head_dim: int, rope: RopeConfig) -> None:
        super().__init__()
        self.register_buffer("inv_freq", rope_inverse_frequencies(head_dim, rope), persistent=False)
        self.mrope_section = list(rope.mrope_section)
        self.mrope_interleaved = rope.mrope_interleaved
        if self.mrope_section and sum(self.mrope_section) != head_dim // 2:
            raise CheckpointError(
                f"mrope_section {self.mrope_section} must add up to head_dim / 2 = {head_dim // 2}"
            )

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for positions ``[T]``, or ``[3, T]`` (time, height, width) of multimodal
        RoPE: frequency section ``i`` turns by position row ``i % 3``."""
        inv_freq: torch.Tensor = self.inv_freq  # type: ignore[assignment]
        freqs = positions[..., None].float() * inv_freq
        if positions.dim() == 2:
            if not self.mrope_section:
                raise ValueError("this model has no multimodal rotary positions")
            if self.mrope_interleaved:
                freqs = _interleaved(freqs, self.mrope_section)
            else:
                parts = freqs.split(self.mrope_section, dim=-1)
                freqs = torch.cat([part[i % 3] for i, part in enumerate(parts)], dim=-1)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _interleaved(freqs: torch.Tensor, section: list[int]) -> torch.Tensor:
    """Interleaved mRoPE's frequencies ``[T, head_dim / 2]`` from the per-row ones
    ``[3, T, head_dim / 2]``: the time row's, with every third from 1 (height) and from 2
    (width) taken from their rows, up to three times their section."""
    out = freqs[0].clone()
    for row in (1, 2):
        idx = slice(row, section[row] * 3, 3)
        out[..., idx] = freqs[row, ..., idx]
    return out


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``[T, heads, head_dim]``) by per-token tables ``[T, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class Attention(nn.Module):
    """Self-attention over this rank's query heads (all of them with one rank) and the kv
    heads they use."""

    def __init__(self, config: ARModelConfig, dtype: torch.dtype, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.head_dim = d = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden, bias = config.hidden_size, config.qkv_bias
        if tp.size == 1:
            self.num_heads = config.num_attention_heads
            self.num_kv_heads = config.num_key_value_heads
            q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
            self.q_proj = nn.Linear(hidden, q_size, bias=bias, dtype=dtype)
            self.k_proj = nn.Linear(hidden, kv_size, bias=bias, dtype=dtype)
            self.v_proj = nn.Linear(hidden, kv_size, bias=bias, dtype=dtype)
            self.o_proj = nn.Linear(q_size, hidden, bias=config.o_bias, dtype=dtype)
        else:
            first_q, self.num_heads = even_split(config.num_attention_heads, tp, "heads")
            first_kv, self.num_kv_heads = kv_head_split(config.num_key_value_heads, tp)
            q = (first_q * d, self.num_heads * d)
            kv = (first_kv * d, self.num_kv_heads * d)
            self.q_proj = ColumnParallelLinear(hidden, *q, bias=bias, dtype=dtype)
            self.k_proj = ColumnParallelLinear(hidden, *kv, bias=bias, dtype=dtype)
            self.v_proj = ColumnParallelLinear(hidden, *kv, bias=bias, dtype=dtype)
            self.o_proj = RowParallelLinear(*q, hidden, bias=config.o_bias, dtype=dtype, tp=tp)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata | None,
        kv_cache: KVCacheLayer | None,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if metadata is None:
            out = causal_attention(q, k, v, [0, num_tokens], self.scale)
        else:
            out = metadata.backend.forward(q, k, v, kv_cache, metadata, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.num_heads * self.head_dim))


class MLP(nn.Module):
    """A gated (SwiGLU) MLP; with ``reduce=False`` a tensor-parallel rank leaves its partial
    output for the caller to sum (an expert's, summed with the other experts' first)."""

    def __init__(
        self,
        config: ARModelConfig,
        dtype: torch.dtype,
        tp: TPGroup = SINGLE,
        *,
        inner: int | None = None,
        expert: bool = False,
    ) -> None:
        super().__init__()
        hidden, bias, plan = config.hidden_size, config.mlp_bias and not expert, config.tp_plan
        inner = inner or config.intermediate_size
        gate_up = plan.expert_gate_up if expert else plan.mlp_gate_up
        down = plan.expert_down if expert else plan.mlp_down
        what = "moe_intermediate_size" if expert else "intermediate_size"
        common: dict[str, Any] = {"bias": bias, "dtype": dtype, "tp": tp, "what": what}
        self.gate_proj = parallel_linear(gate_up, hidden, inner, **common)
        self.up_proj = parallel_linear(gate_up, hidden, inner, **common)
        self.down_proj = parallel_linear(down, inner, hidden, **common, reduce=not expert)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(rowwise(F.silu, self.gate_proj(x)) * self.up_proj(x))


class Experts(nn.Module):
    """A sparse mixture of experts, as transformers' Qwen3-MoE block computes it: a router
    (``gate``) picks each token's ``num_experts_per_tok`` experts by softmax (float32)
    probability, renormalised when ``norm_topk_prob``; each expert (a gated MLP) runs on the
    tokens routed to it, in expert order, and its output, times the token's weight for it, is
    added to the token's; a shared expert, when the model has one, adds its output times
    ``sigmoid(shared_expert_gate(x))`` for every token. With tensor parallelism every expert
    splits over its intermediate features; the partial sums meet in one all-reduce per layer."""

    def __init__(self, config: ARModelConfig, dtype: torch.dtype, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.tp = tp
        self.gate = parallel_linear(
            REPLICATED, config.hidden_size, config.num_experts,
            bias=False, dtype=dtype, tp=tp, what="router",
        )  # fmt: skip
        self.experts = nn.ModuleList(
            [
                MLP(config, dtype, tp, inner=config.moe_intermediate_size, expert=True)
                for _ in range(config.num_experts)
            ]
        )
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Module | None = None
        if config.shared_expert_intermediate_size:
            inner = config.shared_expert_intermediate_size
            self.shared_expert = MLP(config, dtype, tp, inner=inner, expert=True)
            self.shared_expert_gate = parallel_linear(
                REPLICATED, config.hidden_size, 1, bias=False, dtype=dtype, tp=tp, what="router"
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        probs = F.softmax(logits, dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(logits.dtype)
        out = torch.zeros_like(x)
        hit = torch.bincount(chosen.flatten(), minlength=len(self.experts)).nonzero().flatten()
        for e in hit.tolist():
            slot, tokens = torch.where(e == chosen.T)  # transformers' order: by slot, then token
            rows = self.experts[e](x[tokens]) * weights[tokens, slot, None]
            out.index_add_(0, tokens, rows.to(out.dtype))
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp.all_reduce(out)


class DecoderLayer(nn.Module):
    def __init__(
        self, config: ARModelConfig, dtype: torch.dtype, tp: TPGroup = SINGLE, index: int = 0
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, dtype, tp)
        self.mlp: nn.Module = (
            Experts(config, dtype, tp) if config.uses_experts(index) else MLP(config, dtype, tp)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata | None,
        kv_cache: KVCacheLayer | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, metadata, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderModel(nn.Module):
    def __init__(self, config: ARModelConfig, dtype: torch.dtype, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        embed_dim = config.embedding_size or config.hidden_size
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, embed_dim, dtype=dtype)
            if tp.size == 1
            else VocabParallelEmbedding(config.vocab_size, embed_dim, dtype, tp)
        )
        self.layers = nn.ModuleList(
            [DecoderLayer(config, dtype, tp, i) for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.rope)


class CausalLM(PartHooks, nn.Module):
    """A decoder-only causal LM; ``forward`` returns final hidden states, not logits."""

    def __init__(
        self, config: ARModelConfig, dtype: torch.dtype = torch.float32, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        self.model = DecoderModel(config, dtype, tp)
        # Encoders of non-text inputs by modality, when the model family has any: each maps an
        # item's processed data to embeddings of its placeholders (the runner's encoder step).
        self.encoders = nn.ModuleDict()
        # Inputs of another width (a stage fed another stage's embeddings) are projected to
        # the decoder's.
        self.input_proj: nn.Linear | None = None
        if config.embedding_size is not None:
            self.input_proj = nn.Linear(config.embedding_size, config.hidden_size, dtype=dtype)
        self.lm_head = (
            nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
            if tp.size == 1
            else VocabParallelLMHead(config.hidden_size, config.vocab_size, dtype, tp)
        )
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @classmethod
    def on_meta(cls, config: ARModelConfig, dtype: torch.dtype, tp: TPGroup = SINGLE) -> CausalLM:
        """Build without memory for the weights (adopt into an arena, then load)."""
        with torch.device("meta"), no_weight_init():
            return cls(config, dtype, tp)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings ``[T, embedding_size]`` (what ``inputs_embeds`` are made of)."""
        return self.model.embed_tokens(input_ids)

    def project_embeds(self, rows: torch.Tensor) -> torch.Tensor:
        """A request's input embeddings in the width of the token embeddings (the identity
        here; a family whose requests bring another form projects them)."""
        return rows

    def forward(
        self,
        input_ids: torch.Tensor | None,
        positions: torch.Tensor,
        metadata: AttentionMetadata | None = None,
        kv_caches: list[KVCacheLayer] | None = None,
        inputs_embeds: torch.Tensor | None = None,
        layer_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm, from token ids or from
        ``inputs_embeds`` (``[T, embedding_size]``, instead of the ids' embeddings).

        ``layer_rows`` (``at`` ``[N]``, ``rows`` ``[k, N, hidden]``): rows added to the hidden
        states of tokens ``at`` after each of the first ``k`` layers (an encoder's DeepStack
        features). Without ``metadata`` the tokens form one sequence and no cache is used.
        """
        if inputs_embeds is not None:
            x = inputs_embeds
        elif input_ids is not None:
            x = self.embed(input_ids)
        else:
            raise ValueError("give input_ids or inputs_embeds")
        if self.input_proj is not None:
            x = self.input_proj(x)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, metadata, kv_caches[i] if kv_caches is not None else None)
            if layer_rows is not None and i < len(layer_rows[1]):
                at, rows = layer_rows
                x = x.index_put((at,), x[at] + rows[i])  # a new tensor: x may be held
        return self.model.norm(x)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)
