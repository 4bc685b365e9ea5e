"""Attention backends: one object, chosen once per stage, owns the attention metadata of a
forward pass, the layout of a layer's KV cache blocks and whether a decode step may be
captured in a CUDA graph.

The model's attention layers call ``metadata.backend.forward(q, k, v, kv_layer, metadata,
scale)``: the backend stores the new k/v in the cache and attends. The metadata a backend builds
carries everything a kernel needs — for a prefill, the sequences' boundaries in the flat batch
(``cu_seqlens``, what a varlen kernel takes to attend the whole batch in one call) and their
cached prefixes; for a decode, each sequence's block table and length.

Backends (``ATTENTION_BACKENDS``; ``--attention-backend``):

- ``torch_sdpa`` (the CPU default): PyTorch's ``scaled_dot_product_attention``, batch-invariant
  on the CPU — a sequence's result never depends on the rest of the batch (see
  ``omnistage/batch_invariance.py``): prefill attends over each sequence alone, decode groups
  the sequences by their number of blocks and attends over exactly their own blocks.
- ``torch_sdpa_padded`` (the CUDA default): one SDPA call over the batch's padded block tables,
  whose shapes depend only on the table's shape: a decode step can be captured in a CUDA graph.

A GPU kernel backend (FlashAttention, FlashInfer) is one more class here with its own
metadata and cache layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F

KVCacheLayer = tuple[torch.Tensor, torch.Tensor]


@dataclass
class AttentionMetadata:
    """How the tokens of one forward pass map onto sequences and cache slots.

    Prefill: tokens of several sequences are concatenated; ``cu_seqlens`` holds their
    boundaries (``[0, len0, len0 + len1, ...]``), ``prefix_lens`` the tokens each already has
    in the cache (its new tokens start there) with its block table. Decode: one token per
    sequence, whose ``block_tables`` row lists its blocks (padded with any valid block id) and
    whose ``context_lens`` entry counts its tokens including the new one.
    """

    backend: AttentionBackend
    is_prefill: bool
    slot_mapping: torch.Tensor
    cu_seqlens: list[int] | None = None
    prefix_lens: list[int] | None = None
    prefill_block_tables: list[torch.Tensor] | None = None
    block_tables: torch.Tensor | None = None
    context_lens: torch.Tensor | None = None
    scratch: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)


class AttentionBackend(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def supports_cuda_graphs(self) -> bool: ...

    def block_shape(self, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        """One KV cache block of one layer (for k, and alike for v)."""
        ...

    def prefill(
        self,
        slot_mapping: torch.Tensor,
        cu_seqlens: list[int],
        prefix_lens: list[int],
        block_tables: list[torch.Tensor] | None,
    ) -> AttentionMetadata: ...

    def decode(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
    ) -> AttentionMetadata: ...

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCacheLayer | None,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store ``k``/``v`` (``[T, kv_heads, head_dim]``) in the cache and attend ``q``
        (``[T, heads, head_dim]``); returns ``[T, heads, head_dim]``."""
        ...


def store_kv(kv_cache: KVCacheLayer, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """Write ``k``/``v`` (``[T, num_kv_heads, head_dim]``) into the cache slots, in place."""
    k_cache, v_cache = kv_cache
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v.to(v_cache.dtype))


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: list[int], scale: float
) -> torch.Tensor:
    """Causal self-attention of each sequence in a concatenated batch (no cache)."""
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
    metadata: AttentionMetadata,
    kv_cache: KVCacheLayer | None,
    scale: float,
) -> torch.Tensor:
    """Causal attention of a prefill batch; a sequence with a cached prefix attends over the
    cached k/v of its prefix and its new tokens (already stored in the cache)."""
    if metadata.cu_seqlens is None:
        raise ValueError("prefill metadata needs cu_seqlens")
    prefix_lens = metadata.prefix_lens
    if not prefix_lens or not any(prefix_lens):
        return causal_attention(q, k, v, metadata.cu_seqlens, scale)
    if kv_cache is None or metadata.prefill_block_tables is None:
        raise ValueError("a prefill from the prefix cache needs the KV cache and block tables")
    out = torch.empty_like(q)
    bounds = zip(metadata.cu_seqlens[:-1], metadata.cu_seqlens[1:], strict=True)
    for i, (start, end) in enumerate(bounds):
        prefix = prefix_lens[i]
        if not prefix:
            out[start:end] = causal_attention(
                q[start:end], k[start:end], v[start:end], [0, end - start], scale
            )
            continue
        total = prefix + end - start
        k_all, v_all = (c[metadata.prefill_block_tables[i]].flatten(0, 1)[:total] for c in kv_cache)
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


@dataclass
class DecodeGroup:
    """Sequences of one decode step with the same number of blocks, attended in one call."""

    rows: torch.Tensor | None  # their rows in the batch; None: every row
    block_tables: torch.Tensor  # [n, blocks]: exactly their blocks
    mask: torch.Tensor  # [n, 1, 1, blocks * block_size]: True for the slots they hold


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


def grouped_decode_attention(
    q: torch.Tensor, kv_cache: KVCacheLayer, groups: list[DecodeGroup], scale: float
) -> torch.Tensor:
    if len(groups) == 1 and groups[0].rows is None:
        return _attend(q, kv_cache, groups[0].block_tables, groups[0].mask, scale)
    out = torch.empty_like(q)
    for group in groups:
        out[group.rows] = _attend(q[group.rows], kv_cache, group.block_tables, group.mask, scale)
    return out


def padded_decode_attention(
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


class TorchSDPABackend:
    """``scaled_dot_product_attention``, a sequence's result independent of its batch."""

    name: ClassVar[str] = "torch_sdpa"
    supports_cuda_graphs: ClassVar[bool] = False

    def block_shape(self, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[int, ...]:
        return (block_size, num_kv_heads, head_dim)

    def prefill(
        self,
        slot_mapping: torch.Tensor,
        cu_seqlens: list[int],
        prefix_lens: list[int],
        block_tables: list[torch.Tensor] | None,
    ) -> AttentionMetadata:
        return AttentionMetadata(
            self,
            is_prefill=True,
            slot_mapping=slot_mapping,
            cu_seqlens=cu_seqlens,
            prefix_lens=prefix_lens,
            prefill_block_tables=block_tables if any(prefix_lens) else None,
        )

    def decode(
        self, slot_mapping: torch.Tensor, block_tables: torch.Tensor, context_lens: torch.Tensor
    ) -> AttentionMetadata:
        return AttentionMetadata(
            self,
            is_prefill=False,
            slot_mapping=slot_mapping,
            block_tables=block_tables,
            context_lens=context_lens,
        )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCacheLayer | None,
        metadata: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        if kv_cache is not None:
            store_kv(kv_cache, k, v, metadata.slot_mapping)
        if metadata.is_prefill:
            return prefill_attention(q, k, v, metadata, kv_cache, scale)
        tables, lens = metadata.block_tables, metadata.context_lens
        if kv_cache is None or tables is None or lens is None:
            raise ValueError("decode needs a KV cache, block_tables and context_lens")
        return self.decode_attention(q, kv_cache, tables, lens, scale, metadata.scratch)

    def decode_attention(
        self,
        q: torch.Tensor,
        kv_cache: KVCacheLayer,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        scratch: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        """One new token per sequence attending over its cached tokens (its k/v stored).
        ``scratch``: state of the step every layer shares (its decode groups)."""
        scratch = {} if scratch is None else scratch
        groups = scratch.get("decode_groups")
        if groups is None:
            groups = decode_groups(block_tables, context_lens, kv_cache[0].shape[1])
            scratch["decode_groups"] = groups
        return grouped_decode_attention(q, kv_cache, groups, scale)


class PaddedTorchSDPABackend(TorchSDPABackend):
    """One SDPA call per decode step over the padded block tables: capturable in a graph."""

    name: ClassVar[str] = "torch_sdpa_padded"
    supports_cuda_graphs: ClassVar[bool] = True

    def decode_attention(
        self,
        q: torch.Tensor,
        kv_cache: KVCacheLayer,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        scale: float,
        scratch: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        return padded_decode_attention(q, kv_cache, block_tables, context_lens, scale)


ATTENTION_BACKENDS: dict[str, type[TorchSDPABackend]] = {
    TorchSDPABackend.name: TorchSDPABackend,
    PaddedTorchSDPABackend.name: PaddedTorchSDPABackend,
}


def select_backend(device: torch.device, name: str | None = None) -> TorchSDPABackend:
    """The backend a stage on ``device`` runs: ``name`` if given, else the device's default
    (batch-invariant SDPA on the CPU, graph-capturable SDPA on CUDA)."""
    if name is None:
        name = PaddedTorchSDPABackend.name if device.type == "cuda" else TorchSDPABackend.name
    try:
        return ATTENTION_BACKENDS[name]()
    except KeyError:
        raise ValueError(
            f"unknown attention backend {name!r}; known: {sorted(ATTENTION_BACKENDS)}"
        ) from None


def paged_decode_attention(
    q: torch.Tensor,
    kv_cache: KVCacheLayer,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One decode step's attention by the device's default backend (its k/v stored)."""
    backend = select_backend(q.device)
    return backend.decode_attention(q, kv_cache, block_tables, context_lens, scale)
