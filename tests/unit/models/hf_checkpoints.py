"""Tiny random checkpoints that transformers' own classes build and save (Qwen2 with tied
embeddings, Qwen3, Qwen3-MoE with a dense layer among its sparse ones, Llama with llama3
rope): the files a real checkpoint has."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from omnistage.models.tiny_ar import CHAT_TEMPLATE, build_tokenizer

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
ARCHS = ["qwen2-tied", "qwen3", "qwen3-moe", "llama-llama3-rope"]
# Tensor parallelism also meets multi-query attention: one kv head for two ranks.
TP_ARCHS = [*ARCHS, "qwen2-mqa"]


def hf_model(arch: str):
    import transformers as tf

    if arch == "qwen2-tied":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**COMMON, tie_word_embeddings=True))
    if arch == "qwen2-mqa":
        return tf.Qwen2ForCausalLM(tf.Qwen2Config(**{**COMMON, "num_key_value_heads": 1}))
    if arch == "qwen3":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**COMMON, head_dim=32))
    if arch == "qwen3-moe":
        experts = dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**COMMON, head_dim=32, **experts))
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


def build_checkpoint(arch: str, folder: Path):
    """A transformers model with every parameter randomised, saved with save_pretrained."""
    torch.manual_seed(0)
    hf = hf_model(arch).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            param.normal_(1.0 if "norm" in name else 0.0, 0.1 if "norm" in name else 0.05)
    hf.save_pretrained(folder)
    build_tokenizer(VOCAB).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(
        json.dumps({"chat_template": CHAT_TEMPLATE, "eos_token": "<|im_end|>"})
    )
    return hf, folder
