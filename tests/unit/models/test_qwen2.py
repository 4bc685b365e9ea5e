"""The qwen2-family model against transformers on random tiny checkpoints it saved itself."""

import json

import pytest
import torch

from omnistage.config import StageConfig
from omnistage.memory import Arena
from omnistage.models.ar_attention import AttentionContext
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.loader import load_module
from omnistage.models.qwen2 import Qwen2ForCausalLM, checkpoint_rename
from omnistage.models.tiny_ar import CHAT_TEMPLATE, build_tokenizer
from omnistage.stage.ar.engine import ARStageEngine
from omnistage.stage.ar.sampling import SamplingParams
from omnistage.stage.ar.sequence import ARRequest

VOCAB = 512
COMMON = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    vocab_size=VOCAB,
    max_position_embeddings=256,
)


def _hf_model(arch: str):
    import transformers as tf

    if arch == "qwen2-tied":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON, tie_word_embeddings=True))
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, head_dim=32))
    llama3 = {
        "rope_type": "llama3",
        "rope_theta": 50000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    }
    config = tf.LlamaConfig(**COMMON, rope_scaling=llama3, attention_bias=True, mlp_bias=True)
    return tf.LlamaForCausalLM(config)


@pytest.fixture(scope="module", params=["qwen2-tied", "qwen3", "llama-llama3-rope"])
def checkpoint(request, tmp_path_factory):
    """A transformers model with every parameter randomised, saved with save_pretrained."""
    torch.manual_seed(0)
    hf = _hf_model(request.param).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.05)
    folder = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(folder)
    build_tokenizer(VOCAB).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"})
    )
    return hf, folder


def load_ours(folder) -> Qwen2ForCausalLM:
    model = Qwen2ForCausalLM.on_meta(ARModelConfig.from_pretrained(folder), torch.float32)
    Arena("cpu").adopt(model)
    load_module(model, folder, rename=checkpoint_rename)
    return model


def test_config_reads_the_architecture(checkpoint):
    hf, folder = checkpoint
    config = ARModelConfig.from_pretrained(folder)
    assert config.tie_word_embeddings == hf.config.tie_word_embeddings
    assert config.head_dim == hf.model.layers[0].self_attn.head_dim
    assert config.rope.rope_type == hf.config.rope_parameters["rope_type"]


def test_logits_match_transformers(checkpoint):
    hf, folder = checkpoint
    ours = load_ours(folder)
    ids = torch.randint(0, VOCAB, (48,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
        logits = ours.compute_logits(ours(ids, torch.arange(48)))
    assert (logits - expected).abs().max().item() <= 1e-4


def test_paged_decode_logits_match_transformers(checkpoint):
    """Two sequences prefilled into scattered cache blocks, then decoded together."""
    hf, folder = checkpoint
    ours = load_ours(folder)
    config = ours.config
    block_size, num_prefill, length = 4, 10, 24
    shape = (16, block_size, config.num_key_value_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_hidden_layers)]
    tables = [[3, 9, 1, 14, 6, 0], [5, 2, 11, 7, 12, 8]]
    seqs = torch.randint(0, VOCAB, (2, length), generator=torch.Generator().manual_seed(2))

    def slots(seq: int, positions) -> list[int]:
        return [tables[seq][p // block_size] * block_size + p % block_size for p in positions]

    with torch.no_grad():
        expected = hf(seqs).logits
        prefill = AttentionContext(
            is_prefill=True,
            slot_mapping=torch.tensor(slots(0, range(num_prefill)) + slots(1, range(num_prefill))),
            cu_seqlens=[0, num_prefill, 2 * num_prefill],
        )
        ours(seqs[:, :num_prefill].flatten(), torch.arange(num_prefill).repeat(2), prefill, caches)
        for pos in range(num_prefill, length):
            decode = AttentionContext(
                is_prefill=False,
                slot_mapping=torch.tensor(slots(0, [pos]) + slots(1, [pos])),
                block_tables=torch.tensor(tables),
                context_lens=torch.tensor([pos + 1, pos + 1]),
            )
            hidden = ours(seqs[:, pos], torch.tensor([pos, pos]), decode, caches)
            diff = (ours.compute_logits(hidden) - expected[:, pos]).abs().max().item()
            assert diff <= 1e-4, f"position {pos}: {diff}"


def test_greedy_ids_match_transformers_generate(checkpoint):
    hf, folder = checkpoint
    config = StageConfig(
        stage_id=0, kind="ar", model=str(folder), kv_cache_bytes=1 << 20, max_model_len=128
    )
    engine = ARStageEngine(config)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (1, 5, 9, 17, 30)]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(ARRequest(str(i), prompt, params))
    ours: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            ours.setdefault(out.request_id, []).extend(out.new_token_ids)
    for i, prompt in enumerate(prompts):
        with torch.no_grad():
            expected = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=32,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert ours[str(i)] == expected, f"prompt {i}"
    engine.shutdown()
