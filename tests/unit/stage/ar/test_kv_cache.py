import pytest
import torch

from omnistage.config import ConfigError, StageConfig
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.tiny_ar import build_tokenizer
from omnistage.models.tokenizer import IncrementalDetokenizer, Tokenizer
from omnistage.stage.ar.block_manager import BlockManager
from omnistage.stage.ar.kv_cache import plan_kv_cache
from omnistage.stage.ar.sequence import ARRequest, SequenceState

MODEL = ARModelConfig(
    model_type="qwen2",
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
)
BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4  # k+v, layers, block_size, kv heads, head_dim, fp32


def stage(**fields) -> StageConfig:
    return StageConfig(stage_id=0, kind="ar", model="unused", max_model_len=64, **fields)


def plan(config: StageConfig):
    return plan_kv_cache(config, MODEL, torch.float32, torch.device("cpu"))


def test_bytes_budget_sets_the_block_count_minus_scratch():
    result = plan(stage(kv_cache_bytes=11 * BYTES_PER_BLOCK, max_num_seqs=8))
    assert result.num_blocks == 10 and result.bytes_per_block == BYTES_PER_BLOCK


def test_blocks_are_capped_at_what_the_sequences_can_use():
    result = plan(stage(kv_cache_bytes=1000 * BYTES_PER_BLOCK, max_num_seqs=3))
    assert result.num_blocks == 3 * 4  # 3 sequences of 64 tokens in blocks of 16


def test_fraction_of_free_memory_is_used_without_bytes():
    assert plan(stage(kv_cache_memory_fraction=0.01, max_num_seqs=2)).num_blocks == 8


def test_cache_smaller_than_one_sequence_is_a_config_error():
    with pytest.raises(ConfigError, match="kv_cache_memory"):
        plan(stage(kv_cache_bytes=3 * BYTES_PER_BLOCK))


def test_decode_takes_a_new_block_only_at_a_block_boundary():
    manager = BlockManager(num_blocks=3, block_size=4)
    request = ARRequest("s", [1, 2, 3, 4])
    seq = SequenceState(request, IncrementalDetokenizer(Tokenizer(build_tokenizer(300)), []), None)
    manager.allocate(seq)
    assert len(seq.block_table) == 1
    seq.token_ids.append(5)  # the first decode writes position 4: a second block
    manager.may_append(seq)
    seq.token_ids.append(6)
    manager.may_append(seq)
    assert len(seq.block_table) == 2 and manager.num_free_blocks == 1
    manager.free(seq)
    assert manager.num_free_blocks == 3
