"""Megatron-style tensor parallelism for the decoder (``omnistage.models.decoder``).

Each rank holds a slice of every large weight: QKV and the MLP's gate/up projections are
*column-parallel* (a rank computes its own heads / intermediate features), ``o_proj`` and
``down_proj`` *row-parallel* (a rank multiplies its slice of the input features and the partial
outputs are summed over the ranks), the embedding and LM head *vocab-parallel* (a rank holds a
range of token rows: embeddings are summed over ranks, logits gathered). Norms, rotary tables
and biases of row-parallel layers are whole on every rank. Experts split like the MLP, each
over its own intermediate features; their partial outputs are summed over the experts first
and over the ranks once. A model family states how its layers split as a ``TPPlan``.

Which slice of a checkpoint tensor a parameter holds is recorded on its module
(``tp_shards``: parameter name → ``Shard``), so the loader reads each rank's slice straight from
the checkpoint files (``shards_of``). With one rank every class here behaves like its
``torch.nn`` parent and nothing is recorded.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Shard:
    """The slice ``[start, start + length)`` along ``dim`` of a checkpoint tensor that a
    parameter holds, in its first ``length`` entries along ``dim`` (the rest, vocab padding,
    stays zero)."""

    dim: int
    start: int
    length: int


@dataclass(frozen=True)
class TPGroup:
    """This rank's place in its stage's tensor-parallel group. ``group`` is a
    ``torch.distributed`` process group object (gloo on the CPU, NCCL on CUDA) used directly,
    not registered as the process's default group, so that several stages (or tests) in one
    process keep their groups apart; None with one rank."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place."""
        if self.size > 1:
            self.group.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's ``x`` side by side along the last dimension."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)


def join_group(store_path: str, rank: int, size: int, device: torch.device) -> TPGroup:
    """Join the ``size``-rank group whose rendezvous is the file ``store_path`` (every rank
    blocks here until all have joined): NCCL on CUDA, gloo elsewhere."""
    import datetime

    import torch.distributed as dist

    store = dist.FileStore(store_path, size)
    # Idle stages wait on requests, never inside a collective: the timeout only bounds a
    # collective whose peer died, which the stage's watchdog ends sooner.
    timeout = datetime.timedelta(minutes=30)
    if device.type == "cuda":
        group: Any = dist.ProcessGroupNCCL(store, rank, size, dist.ProcessGroupNCCL.Options())
    else:
        group = dist.ProcessGroupGloo(store, rank, size, timeout)
    return TPGroup(rank, size, group)


SINGLE = TPGroup()

from omnistage.models.tp_plan import COLWISE, DENSE_PLAN, REPLICATED, ROWWISE, TPPlan  # noqa: E402

__all__ = ["COLWISE", "DENSE_PLAN", "REPLICATED", "ROWWISE", "TPPlan"]


def parallel_linear(
    style: str,
    in_features: int,
    out_features: int,
    *,
    bias: bool,
    dtype: torch.dtype,
    tp: TPGroup,
    what: str,
    reduce: bool = True,
) -> nn.Linear:
    """A linear layer split over ``tp`` as ``style`` says (a plain one with one rank).
    ``reduce=False``: a row-parallel layer leaves its partial output for the caller to sum."""
    if tp.size == 1 or style == REPLICATED:
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    if style == COLWISE:
        return ColumnParallelLinear(
            in_features, *even_split(out_features, tp, what), bias=bias, dtype=dtype
        )
    if style == ROWWISE:
        start, length = even_split(in_features, tp, what)
        return RowParallelLinear(start, length, out_features, bias, dtype, tp, reduce=reduce)
    raise ValueError(f"unknown tensor-parallel style {style!r} for {what}")


def even_split(total: int, tp: TPGroup, what: str) -> tuple[int, int]:
    """``(start, length)`` of this rank's equal share of ``total`` (which the ranks divide)."""
    if total % tp.size:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size {tp.size}")
    per = total // tp.size
    return tp.rank * per, per


def padded_split(total: int, tp: TPGroup) -> tuple[int, int, int]:
    """``(start, length, rows)``: this rank's share of ``total`` rows split in ``rows``-row
    blocks (the last rank's block padded when the ranks do not divide ``total``)."""
    rows = -(-total // tp.size)
    start = min(total, tp.rank * rows)
    return start, min(rows, total - start), rows


def kv_head_split(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """``(first kv head, kv heads)`` of this rank: split when the ranks divide the kv heads,
    replicated (each rank the one its query heads use) when the kv heads divide the ranks."""
    if num_kv_heads % tp.size == 0:
        per = num_kv_heads // tp.size
        return tp.rank * per, per
    if tp.size % num_kv_heads == 0:
        return tp.rank * num_kv_heads // tp.size, 1
    raise ValueError(
        f"num_key_value_heads ({num_kv_heads}) and tensor_parallel_size ({tp.size}): "
        "one must divide the other"
    )


def rank_heads(num_heads: int, num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """``(query heads, kv heads)`` one rank computes."""
    if tp.size == 1:
        return num_heads, num_kv_heads
    return even_split(num_heads, tp, "heads")[1], kv_head_split(num_kv_heads, tp)[1]


class ColumnParallelLinear(nn.Linear):
    """This rank's output features ``[start, start + length)`` of a linear layer."""

    def __init__(
        self, in_features: int, start: int, length: int, bias: bool, dtype: torch.dtype
    ) -> None:
        super().__init__(in_features, length, bias=bias, dtype=dtype)
        self.tp_shards = {"weight": Shard(0, start, length)}
        if bias:
            self.tp_shards["bias"] = Shard(0, start, length)


class RowParallelLinear(nn.Linear):
    """This rank's input features ``[start, start + length)``; partial outputs summed over
    the ranks (unless ``reduce`` is False: the caller sums), then the (whole) bias added
    once."""

    def __init__(
        self,
        start: int,
        length: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        tp: TPGroup,
        reduce: bool = True,
    ) -> None:
        super().__init__(length, out_features, bias=bias, dtype=dtype)
        self.tp = tp
        self.reduce = reduce
        self.tp_shards = {"weight": Shard(1, start, length)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        if self.reduce:
            out = self.tp.all_reduce(out)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """Token rows ``[start, start + length)`` (padded to ``rows``); other ranks' tokens read
    as zeros here and the sum over ranks gives every token its row."""

    def __init__(self, vocab_size: int, dim: int, dtype: torch.dtype, tp: TPGroup) -> None:
        self.start, length, rows = padded_split(vocab_size, tp)
        super().__init__(rows, dim, dtype=dtype)
        self.tp = tp
        self.vocab_size = vocab_size
        self.tp_shards = {"weight": Shard(0, self.start, length)}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class VocabParallelLMHead(nn.Linear):
    """Logits of this rank's token rows, gathered from every rank into the whole vocabulary."""

    def __init__(self, hidden: int, vocab_size: int, dtype: torch.dtype, tp: TPGroup) -> None:
        start, length, rows = padded_split(vocab_size, tp)
        super().__init__(hidden, rows, bias=False, dtype=dtype)
        self.tp = tp
        self.vocab_size = vocab_size
        self.tp_shards = {"weight": Shard(0, start, length)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(F.linear(x, self.weight))[..., : self.vocab_size]


def shards_of(module: nn.Module) -> dict[str, Shard]:
    """Every sharded parameter of ``module`` by state-dict name."""
    found: dict[str, Shard] = {}
    for prefix, sub in _named_modules(module):
        for name, shard in getattr(sub, "tp_shards", {}).items():
            found[f"{prefix}{name}"] = shard
    return found


def _named_modules(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    for name, sub in module.named_modules(remove_duplicate=False):
        yield (f"{name}." if name else ""), sub
