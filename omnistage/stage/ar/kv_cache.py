"""The paged KV cache: one arena allocation under tag ``kv_cache``, sized once at start-up.

Layout ``[2 (k, v), num_layers, num_blocks + 1, *block]``, a block's shape as the stage's
attention backend lays it out (``[block_size, num_kv_heads, head_dim]`` for the SDPA
backends). The extra last block is a scratch block no sequence ever owns: padded rows of a
captured decode graph write their k/v there.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from omnistage.config import ConfigError, StageConfig
from omnistage.memory import Arena
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.attention import AttentionBackend, KVCacheLayer
from omnistage.stage.vocabulary import KV_CACHE


@dataclass(frozen=True)
class KVCachePlan:
    num_blocks: int
    block_size: int
    bytes_per_block: int

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available)


def kv_cache_budget(config: StageConfig, device: torch.device) -> tuple[int, str]:
    """Bytes the KV cache may take, and the setting that decided it.

    ``kv_cache_memory`` (bytes) wins; on CUDA ``gpu_memory_utilization`` leaves the cache
    what remains of that share of the device once everything already on it (this stage's
    weights, other stages, other processes) is counted; else ``kv_cache_memory_fraction``
    of the free memory."""
    if config.ar.kv_cache_memory is not None:
        return config.ar.kv_cache_memory, "kv_cache_memory"
    if config.ar.gpu_memory_utilization is not None and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        used = total - free
        return max(
            0, int(total * config.ar.gpu_memory_utilization) - used
        ), "gpu_memory_utilization"
    fraction = config.ar.kv_cache_memory_fraction
    return int(available_memory_bytes(device) * fraction), "kv_cache_memory_fraction"


def resolved_max_model_len(config: StageConfig) -> int:
    """``max_model_len`` of a stage config resolved at start-up (``omnistage.stage.resolve``)."""
    if config.ar.max_model_len is None:
        raise ValueError(f"stage {config.stage_id}: max_model_len is not resolved yet")
    return config.ar.max_model_len


def plan_kv_cache(
    config: StageConfig, model: ARModelConfig, dtype: torch.dtype, device: torch.device
) -> KVCachePlan:
    """How many blocks to allocate: ``kv_cache_memory``, else ``kv_cache_memory_fraction`` of
    the free memory, capped at what ``max_num_seqs`` sequences of ``max_model_len`` tokens
    can use (more could never be touched). Raises ``ConfigError`` if one full-length
    sequence does not fit, since it could then never finish."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    bytes_per_block = (
        (2 * model.num_hidden_layers * config.ar.block_size * model.num_key_value_heads)
        * model.head_dim
        * itemsize
    )
    max_model_len = resolved_max_model_len(config)
    blocks_per_seq = -(-max_model_len // config.ar.block_size)
    budget, setting = kv_cache_budget(config, device)
    num_blocks = min(budget // bytes_per_block - 1, blocks_per_seq * config.ar.max_num_seqs)
    if num_blocks < blocks_per_seq:
        raise ConfigError(
            f"the KV cache ({budget} bytes) holds {max(num_blocks, 0) * config.ar.block_size} tokens, "
            f"fewer than max_model_len={max_model_len}; raise {setting} "
            f"(at least {(blocks_per_seq + 1) * bytes_per_block} bytes) or lower max_model_len"
        )
    return KVCachePlan(num_blocks, config.ar.block_size, bytes_per_block)


class KVCache:
    def __init__(
        self,
        arena: Arena,
        model: ARModelConfig,
        plan: KVCachePlan,
        dtype: torch.dtype,
        backend: AttentionBackend,
    ) -> None:
        self.plan = plan
        block = backend.block_shape(plan.block_size, model.num_key_value_heads, model.head_dim)
        shape = (2, model.num_hidden_layers, plan.num_blocks + 1, *block)
        # Blocks are handed out from the first on, so a woken cache needs only the pages its
        # first requests touch: the rest comes in as later ones grow into it.
        self.tensor = arena.empty(shape, dtype, KV_CACHE, on_touch=True)
        self.clear()  # also faults the pages in: resident figures then match reserved ones
        self.layers: list[KVCacheLayer] = [
            (self.tensor[0, i], self.tensor[1, i]) for i in range(model.num_hidden_layers)
        ]
        self.scratch_slot = plan.num_blocks * plan.block_size

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def copy_block(self, src: int, dst: int) -> None:
        """Block ``dst`` of every layer becomes a copy of block ``src``."""
        self.tensor[:, :, dst].copy_(self.tensor[:, :, src])

    def clear(self) -> None:
        """Zero the cache: masked slots then never hold NaN bit patterns (0 * NaN = NaN)."""
        self.tensor.zero_()
