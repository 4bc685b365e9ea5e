"""Paged attention in plain PyTorch: write k/v into cache blocks, attend with SDPA.

The KV cache of one layer is a pair of tensors ``[num_blocks, block_size, num_kv_heads,
head_dim]``; a token's *slot* is ``block_id * block_size + offset``. Prefill attends over the
freshly computed k/v of each sequence — and, for a sequence whose first blocks were found in
the prefix cache (``prefix_lens``), over those cached k/v too, gathered through its block
table; decode gathers each sequence's blocks through its block table and masks the slots past
its length. Correct and simple first: no custom kernels.

On the CPU a sequence's attention never depends on what else is in the batch (see
``omnistage/batch_invariance.py``): prefill attends over each sequence alone, and decode
attends over exactly the sequence's own blocks, never over the widest block table of the batch
— the CPU kernel splits keys into 512-slot chunks and its sums change with the length of the
last chunk, masked slots included. Sequences with as many blocks share one call
(``DecodeGroup``); the groups are worked out once per step and shared by every layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    # Prefill from the prefix cache: per sequence, the tokens already in the cache (the new
    # ones start there) and its block table.
    prefix_lens: list[int] | None = None
    prefill_block_tables: list[torch.Tensor] | None = None
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    _decode_groups: list[DecodeGroup] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    def decode_groups(self, block_size: int) -> list[DecodeGroup]:
        """The CPU decode groups of this step (``decode_groups``), made on first use."""
        if self.block_tables is None or self.context_lens is None:
            raise ValueError("decode needs block_tables and context_lens")
        if self._decode_groups is None:
            self._decode_groups = decode_groups(self.block_tables, self.context_lens, block_size)
        return self._decode_groups


@dataclass
class DecodeGroup:
    """Sequences of one decode step with the same number of blocks, attended in one call."""

    rows: torch.Tensor | None  # their rows in the batch; None: every row
    block_tables: torch.Tensor  # [n, blocks]: exactly their blocks
    mask: torch.Tensor  # [n, 1, 1, blocks * block_size]: True for the slots they hold


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


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    context: AttentionContext,
    kv_cache: KVCacheLayer | None,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a prefill batch; a sequence with a cached prefix attends over the
    cached k/v of its prefix and its new tokens (already stored in the cache)."""
    if context.cu_seqlens is None:
        raise ValueError("a prefill AttentionContext needs cu_seqlens")
    prefix_lens = context.prefix_lens
    if not prefix_lens or not any(prefix_lens):
        return causal_attention(q, k, v, context.cu_seqlens, scale)
    if kv_cache is None or context.prefill_block_tables is None:
        raise ValueError("a prefill from the prefix cache needs the KV cache and block tables")
    out = torch.empty_like(q)
    bounds = zip(context.cu_seqlens[:-1], context.cu_seqlens[1:], strict=True)
    for i, (start, end) in enumerate(bounds):
        prefix = prefix_lens[i]
        if not prefix:
            out[start:end] = causal_attention(
                q[start:end], k[start:end], v[start:end], [0, end - start], scale
            )
            continue
        total = prefix + end - start
        k_all, v_all = (c[context.prefill_block_tables[i]].flatten(0, 1)[:total] for c in kv_cache)
        # New token j sits at position prefix + j and sees every position up to its own.
        mask = torch.arange(total, device=q.device)[None, :] <= (
            prefix + torch.arange(end - start, device=q.device)[:, None]
        )
        attn = F.scaled_dot_product_attention(
            q[start:end].transpose(0, 1).unsqueeze(0),
            k_all.to(q.dtype).transpose(0, 1).unsqueeze(0),
            v_all.to(q.dtype).transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
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

    ``q`` is ``[B, num_heads, head_dim]``; the new token's k/v must already be stored. On the
    CPU each sequence attends over exactly its own blocks (``decode_groups``), so its result
    does not depend on the batch. Elsewhere it is one call over the batch's padded block
    tables, whose shapes depend only on ``block_tables``' shape, so the call can be captured
    in a CUDA graph. ``decode_attention`` does the same with the groups kept per step.
    """
    if q.device.type != "cpu":
        return _padded_decode_attention(q, kv_cache, block_tables, context_lens, scale)
    groups = decode_groups(block_tables, context_lens, kv_cache[0].shape[1])
    return _grouped_decode_attention(q, kv_cache, groups, scale)


def decode_attention(
    q: torch.Tensor, kv_cache: KVCacheLayer, context: AttentionContext, scale: float
) -> torch.Tensor:
    """``paged_decode_attention`` for a decode ``context``, whose CPU groups every layer of the
    step shares."""
    if context.block_tables is None or context.context_lens is None:
        raise ValueError("decode needs block_tables and context_lens")
    if q.device.type != "cpu":
        return _padded_decode_attention(
            q, kv_cache, context.block_tables, context.context_lens, scale
        )
    groups = context.decode_groups(kv_cache[0].shape[1])
    return _grouped_decode_attention(q, kv_cache, groups, scale)


def decode_groups(
    block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
) -> list[DecodeGroup]:
    """Group a decode batch by each sequence's own number of blocks.

    A sequence then attends over its length rounded up to a block, whatever else is in the
    batch: a function of the sequence alone, which bit-identity needs, at no more work than
    its own blocks. (Exact lengths would give as many calls as distinct lengths; padding to a
    power of two doubles the work of a batch of equal lengths: both measured slower.)
    """
    by_blocks: dict[int, list[int]] = {}
    for i, length in enumerate(context_lens.tolist()):
        by_blocks.setdefault(-(-length // block_size), []).append(i)
    groups = []
    for num_blocks, rows in by_blocks.items():
        index = None if len(by_blocks) == 1 else torch.tensor(rows, device=block_tables.device)
        tables = block_tables if index is None else block_tables[index]
        lens = context_lens if index is None else context_lens[index]
        slots = torch.arange(num_blocks * block_size, device=block_tables.device)
        mask = (slots[None, :] < lens[:, None]).view(len(rows), 1, 1, -1)
        groups.append(DecodeGroup(index, tables[:, :num_blocks], mask))
    return groups


def _grouped_decode_attention(
    q: torch.Tensor, kv_cache: KVCacheLayer, groups: list[DecodeGroup], scale: float
) -> torch.Tensor:
    if len(groups) == 1 and groups[0].rows is None:
        return _attend(q, kv_cache, groups[0].block_tables, groups[0].mask, scale)
    out = torch.empty_like(q)
    for group in groups:
        out[group.rows] = _attend(q[group.rows], kv_cache, group.block_tables, group.mask, scale)
    return out


def _padded_decode_attention(
    q: torch.Tensor,
    kv_cache: KVCacheLayer,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One call over every sequence's ``block_tables`` row, slots past its length masked."""
    batch, max_blocks = block_tables.shape
    positions = torch.arange(max_blocks * kv_cache[0].shape[1], device=q.device)
    mask = (positions[None, :] < context_lens[:, None]).view(batch, 1, 1, -1)
    return _attend(q, kv_cache, block_tables, mask, scale)


def _attend(
    q: torch.Tensor,
    kv_cache: KVCacheLayer,
    block_tables: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """SDPA of ``q`` (``[B, heads, dim]``) over the blocks of ``block_tables`` where ``mask``."""
    k_cache, v_cache = kv_cache
    # [B, blocks, block_size, kv_heads, dim] -> [B, kv_heads, blocks * block_size, dim]
    k = k_cache[block_tables].flatten(1, 2).transpose(1, 2)
    v = v_cache[block_tables].flatten(1, 2).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.squeeze(2)
