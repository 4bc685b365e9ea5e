"""What the omni families' tiny checkpoint builders (``qwen2_5_omni.tiny``,
``qwen3_omni.tiny``) share: the special tokens' ids, the seeded randomisation of a
transformers model, and the folder they write (tokenizer, configs, safetensors). Each family
says its tokens, its config and its gains."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer

from omnistage.models import tiny_ar

NORM_STD = 0.1
SMALL_STD = 0.05
# What the real omni folders' preprocessor_config.json share: Whisper log-mel features of
# 16 kHz audio (128 bins, 30 s windows) and Qwen2-VL image patches merged 2 x 2.
PREPROCESSOR_COMMON: dict[str, Any] = {
    "chunk_length": 300,
    "dither": 0.0,
    "feature_extractor_type": "WhisperFeatureExtractor",
    "feature_size": 128,
    "hop_length": 160,
    "image_processor_type": "Qwen2VLImageProcessor",
    "merge_size": 2,
    "min_pixels": 3136,
    "n_fft": 400,
    "n_samples": 4800000,
    "nb_max_frames": 30000,
    "padding_side": "right",
    "padding_value": 0.0,
    "return_attention_mask": True,
    "sampling_rate": 16000,
    "temporal_patch_size": 2,
}


def special_token_ids(tokenizer: Tokenizer, tokens: Sequence[str]) -> dict[str, int]:
    """The id of each of ``tokens`` (``ValueError`` when the tokenizer lacks one)."""
    ids = {}
    for token in tokens:
        token_id = tokenizer.token_to_id(token)
        if token_id is None:
            raise ValueError(f"the tokenizer lacks special token {token!r}")
        ids[token] = int(token_id)
    return ids


def is_norm(module: torch.nn.Module) -> bool:
    return isinstance(module, torch.nn.LayerNorm | torch.nn.GroupNorm) or type(
        module
    ).__name__.endswith("RMSNorm")


@torch.no_grad()
def randomise(
    model: torch.nn.Module, seed: int, gains: Mapping[str, float], expert_gain: float = 1.0
) -> None:
    """Every parameter from a generator seeded with ``seed``, in ``named_parameters`` order
    (tied parameters once): norm weights N(1, 0.1); matrices and kernels N(0, 1 / fan_in)
    (expert banks [E, out, in]: fan_in = in), times ``gains[name]`` (``expert_gain`` for the
    experts' down projections), so signals keep their scale through every part; the rest
    (biases, layer scales, SnakeBeta's log-scales) N(0, 0.05^2)."""
    generator = torch.Generator().manual_seed(seed)
    norms = {name for name, module in model.named_modules() if is_norm(module)}
    for name, param in model.named_parameters():
        owner, _, leaf = name.rpartition(".")
        noise = torch.randn(param.shape, generator=generator)
        if owner in norms and leaf == "weight":
            param.copy_(1.0 + NORM_STD * noise)
        elif param.ndim >= 2:
            experts = owner.endswith(".experts")
            # in x kernel (Linear, Conv1d/3d); dim for embeddings; in for expert banks
            fan_in = param.shape[-1] if experts else param[0].numel()
            gain = expert_gain if name.endswith("experts.down_proj") else gains.get(name, 1.0)
            param.copy_(noise * (gain / fan_in**0.5))
        else:
            param.copy_(SMALL_STD * noise)


def write_folder(
    out: str | Path,
    tokenizer: Tokenizer,
    ids: Mapping[str, int],
    *,
    chat_template: str,
    max_len: int,
    make: Callable[[], torch.nn.Module],
    randomise: Callable[[torch.nn.Module, int], None],
    seed: int,
    max_shard_size: str | None,
    preprocessor_config: dict[str, Any],
    **tokenizer_extra: Any,
) -> Path:
    """Write a tiny omni checkpoint folder: ``tokenizer.json``, ``tokenizer_config.json``
    (``chat_template``, ``tokenizer_extra``), the model ``make`` builds, randomised from
    ``seed`` (``tiny_ar.save_seeded``), ``generation_config.json`` (the thinker's: it stops at
    ``<|im_end|>``) and ``preprocessor_config.json``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    config = tiny_ar.tokenizer_config(chat_template, max_len, **tokenizer_extra)
    tiny_ar.write_json(out / "tokenizer_config.json", config)
    tiny_ar.save_seeded(make, randomise, out, seed, max_shard_size)
    tiny_ar.write_json(
        out / "generation_config.json",
        {
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
            "pad_token_id": ids["<|endoftext|>"],
        },
    )
    tiny_ar.write_json(out / "preprocessor_config.json", preprocessor_config)
    return out
