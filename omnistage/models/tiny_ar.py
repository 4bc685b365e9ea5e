"""Tiny random-initialised Qwen2 checkpoints in HF layout, built deterministically.

``build_demo`` and ``build_bench`` write ``config.json``, ``generation_config.json``,
``model.safetensors``, a byte-level BPE ``tokenizer.json`` trained with the ``tokenizers``
library on a built-in corpus, and ``tokenizer_config.json`` with a ChatML template. Same
preset → same bytes: everything is seeded and nothing records a time or a path.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from omnistage.models import qwen2
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.decoder import CausalLM

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)
INIT_STD = 0.05  # 0.02 gives greedy loops of 5-7 distinct tokens; 0.05 varied gibberish

_CORPUS = """\
The quick brown fox jumps over the lazy dog. A stage that sleeps gives its memory back and
wakes with exactly the same weights. Omni models think in text, then speak and draw: a thinker
writes tokens, a talker turns them into speech, a decoder paints an image from hidden states.
Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is the
capital of France. Tell me a story about a robot who learned to paint with light and water.
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159. Code: def main(): return print("hi").
Unicode: café, naïve, über, 東京, 你好, こんにちは, 🙂, ∑ ∫ √ ≤ ≥ → ←.
"""
_SYLLABLE_TEXT = (
    "ka ri to mo na se lu vi da pe qo zu ba ne hi ro shi mi ta ke su no wa yo an en in on un "
    "ar er ir or ur al el il ol ul ing ion ent ous ive able ment ness"
)
_SYLLABLES = tuple(_SYLLABLE_TEXT.split(" "))


@dataclass(frozen=True)
class TinyARSpec:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    vocab_size: int
    tie_word_embeddings: bool
    max_position_embeddings: int = 4096
    seed: int = 0


DEMO = TinyARSpec(256, 4, 4, 2, 1024, 512, tie_word_embeddings=False)
BENCH = TinyARSpec(768, 12, 12, 2, 2048, 32000, tie_word_embeddings=True)


def _corpus(num_words: int, seed: int) -> list[str]:
    """The built-in text plus seeded pseudo-words, so large vocabularies find merges."""
    rng = random.Random(seed)
    lines = _CORPUS.splitlines()
    words = [
        "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4))) for _ in range(num_words)
    ]
    lines += [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    return lines * 2


def build_tokenizer(
    vocab_size: int,
    seed: int = 0,
    special_tokens: tuple[str, ...] = SPECIAL_TOKENS,
    extra_lines: tuple[str, ...] = (),
) -> Tokenizer:
    """A byte-level BPE tokenizer with at most ``vocab_size`` tokens (``special_tokens``
    first), trained on the built-in corpus and ``extra_lines``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = _corpus(min(vocab_size * 8, 200_000), seed) + list(extra_lines)
    tokenizer.train_from_iterator(lines, trainer)
    if tokenizer.get_vocab_size() > vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens > {vocab_size}")
    return tokenizer


def hf_config(spec: TinyARSpec, bos_id: int, eos_id: int) -> dict[str, Any]:
    return {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_hidden_layers,
        "num_attention_heads": spec.num_attention_heads,
        "num_key_value_heads": spec.num_key_value_heads,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_hidden_layers,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "tie_word_embeddings": spec.tie_word_embeddings,
        "use_sliding_window": False,
        "sliding_window": None,
        "attention_dropout": 0.0,
        "initializer_range": INIT_STD,
        "vocab_size": spec.vocab_size,
        "bos_token_id": bos_id,
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
        "use_cache": True,
    }


def random_weights(config: ARModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded weights for every checkpoint tensor: norms at 1, the rest N(0, INIT_STD)."""
    model = CausalLM.on_meta(config, torch.float32)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, meta in model.state_dict().items():
        if config.tie_word_embeddings and name == "lm_head.weight":
            continue  # tied to the embedding, which is saved once (as HF does)
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(meta.shape)
        else:
            tensors[name] = torch.randn(meta.shape, generator=generator) * INIT_STD
    return tensors


def _special_id(tokenizer: Tokenizer, token: str) -> int:
    token_id = tokenizer.token_to_id(token)
    if token_id is None:
        raise ValueError(f"the tokenizer lacks special token {token!r}")
    return int(token_id)


def write_json(path: Path, data: dict[str, Any]) -> None:
    """A checkpoint's JSON file, byte-stable (sorted keys, no timestamps)."""
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def tokenizer_config(chat_template: str, max_len: int, **extra: Any) -> dict[str, Any]:
    """``tokenizer_config.json`` of a tiny checkpoint: its chat template, ``<|im_end|>`` as
    eos, ``<|endoftext|>`` as pad, a fast tokenizer."""
    return {
        "chat_template": chat_template,
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "model_max_length": max_len,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "clean_up_tokenization_spaces": False,
        **extra,
    }


def save_seeded(
    make: Callable[[], torch.nn.Module],
    randomise: Callable[[torch.nn.Module, int], None],
    out: Path,
    seed: int,
    max_shard_size: str | None = None,
) -> None:
    """Build a transformers model with ``make`` under ``seed`` (the global generator left as it
    was), randomise it from ``seed`` and ``save_pretrained`` it into ``out``, quietly."""
    from transformers.utils import logging as hf_logging

    verbosity, progress = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # config chatter
    hf_logging.disable_progress_bar()  # "Writing model shards"
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = make().eval()
        randomise(model, seed)
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(out, safe_serialization=True, **kwargs)  # type: ignore[operator]
    finally:
        hf_logging.set_verbosity(verbosity)
        if progress:
            hf_logging.enable_progress_bar()


def build(spec: TinyARSpec, out: str | Path) -> Path:
    """Write a complete checkpoint for ``spec`` into the folder ``out``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.vocab_size, spec.seed)
    if tokenizer.get_vocab_size() > spec.vocab_size:
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} tokens > {spec.vocab_size}")
    tokenizer.save(str(out / "tokenizer.json"))
    bos_id, eos_id = _special_id(tokenizer, "<|endoftext|>"), _special_id(tokenizer, "<|im_end|>")
    config = hf_config(spec, bos_id, eos_id)
    write_json(out / "config.json", config)
    write_json(
        out / "generation_config.json",
        {"bos_token_id": bos_id, "eos_token_id": [eos_id, bos_id], "pad_token_id": bos_id},
    )
    write_json(
        out / "tokenizer_config.json", tokenizer_config(CHAT_TEMPLATE, spec.max_position_embeddings)
    )
    weights = random_weights(qwen2.FAMILY.decoder_config(config), spec.seed)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build_demo(out: str | Path) -> Path:
    """hidden 256 / 4 layers / 4 heads / 2 kv heads / vocab 512, untied, fp32 (~17 MB)."""
    return build(DEMO, out)


def build_bench(out: str | Path) -> Path:
    """hidden 768 / 12 layers / 12 heads / 2 kv heads / vocab 32000, tied, fp32 (~391 MB)."""
    return build(BENCH, out)
