"""Paged attention in plain PyTorch: write k/v into cache blocks, attend with SDPA.

The KV cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads,
head_dim]``; a token's *slot* is ``block_id * block_size + offset``. Prefill attends over the
freshly computed k/v of each sequence (no prefix is ever cached, so a prefill always starts at
position 0); decode gathers each sequence's blocks through its block table and masks the
slots past its length. Correct and simple first: no custom kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KVCacheLayer = tuple[torch.Tensor, torch.Tensor]


@dataclass
class AttentionContext:
    """How the tokens of one forward pass map onto sequences and cache slots.

    Prefill: tokens of several sequences are concatenated; ``cu_seqlens`` holds their
    boundaries (``[0, len0, len0 + len1, ...]``). Decode: one token per sequence, whose
    ``block_tables`` row lists its blocks (padded with any valid block id) and whose
    ``context_lens`` entry counts its tokens including the new one.
    """

    is_prefill: bool
    slot_mapping: torch.Tensor
    cu_seqlens: list[int] | None = None
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None


def store_kv(kv_cache: KVCacheLayer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``k``/``v`` (``[T, num_kv_heads, head_dim]``) into the cache slots, in place."""
    k_cache, v_cache = kv_cache
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v.to(v_cache.dtype))


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    """Causal self-attention of each sequence in a concatenated batch.

    ``q`` is ``[T, num_heads, head_dim]``, ``k``/``v`` ``[T, num_kv_heads, head_dim]``.
    """
    out = torch.empty_like(q)
    for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:], strict=True):
        attn = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),
            k[start:end].transpose(0, 1).unsqueeze(0),
            v[start:end].transpose(0, 1).unsqueeze(0),
            is_causal=True,
            scale=scale,
            enable_gqa=True,
        )
        out[start:end] = attn[0].transpose(0, 1)
    return out


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: KVCacheLayer,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one new token per sequence over its cached tokens.

    ``q`` is ``[B, num_heads, head_dim]``; the new token's k/v must already be stored.
    Shapes depend only on ``block_tables``' shape, so the call can be captured in a graph.
    """
    k_cache, v_cache = kv_cache
    batch, max_blocks = block_tables.shape
    max_len = max_blocks * k_cache.shape[1]
    # [B, blocks, block_size, kv_heads, dim] -> [B, kv_heads, blocks * block_size, dim]
    k = k_cache[block_tables].flatten(1, 2).transpose(1, 2)
    v = v_cache[block_tables].flatten(1, 2).transpose(1, 2)
    positions = torch.arange(max_len, device=q.device)
    mask = (positions[None, :] < context_lens[:, None]).view(batch, 1, 1, max_len)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)
