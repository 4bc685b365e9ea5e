"""The configuration of a qwen2-family decoder, read from an HF-layout ``config.json``.

One frozen dataclass covers Qwen2/Qwen2.5 (bias on q/k/v), Qwen3 (per-head q/k RMSNorm,
explicit ``head_dim``) and Llama (optional bias everywhere). Both the transformers-4 keys
(``rope_theta`` + ``rope_scaling``) and the transformers-5 ``rope_parameters`` are understood.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnistage.errors import CheckpointError

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ARModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None  # what the checkpoint was saved in ("bfloat16", ...)
    # A part of a multi-part checkpoint (Qwen2.5-Omni "thinker" / "talker"), else None.
    checkpoint_part: str | None = None
    # Input embeddings of another width, projected to hidden_size (the Qwen2.5-Omni talker).
    embedding_size: int | None = None
    suppress_token_ids: tuple[int, ...] = ()  # never sampled (the talker's codec bos)
    emits_text: bool = True  # False: the tokens are codes, not text (no detokenizing)

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ARModelConfig:
        """Validate an HF config dict; raises ``CheckpointError`` naming what is unsupported."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            )
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("use_sliding_window"):
            raise CheckpointError("use_sliding_window=true is not supported")
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            config = cls(
                model_type=model_type,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_hidden_layers=int(raw["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=kv_heads,
                head_dim=int(raw.get("head_dim") or hidden // heads),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=_rope_config(raw),
                max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                # Qwen2 always has q/k/v bias and never an o bias; the others follow the flag.
                qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
                o_bias=model_type != "qwen2" and bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                qk_norm=model_type == "qwen3",
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_ids(raw.get("eos_token_id")),
                # transformers 5 writes "dtype", 4 "torch_dtype".
                torch_dtype=_dtype_name(raw.get("dtype") or raw.get("torch_dtype")),
            )
        except KeyError as exc:
            raise CheckpointError(f"config.json lacks required key {exc.args[0]!r}") from exc
        if heads % kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        return config

    @classmethod
    def from_pretrained(cls, path: str | Path, model_stage: str | None = None) -> ARModelConfig:
        """The config of the checkpoint in ``path``; for a multi-part checkpoint (Qwen2.5-Omni)
        the config of the part ``model_stage`` names."""
        from omnistage.models import qwen_omni

        file = Path(path) / "config.json"
        if not file.is_file():
            raise CheckpointError(f"no config.json in {path}")
        raw = json.loads(file.read_text())
        if isinstance(raw, dict) and raw.get("model_type") == qwen_omni.MODEL_TYPE:
            part = qwen_omni.ar_part_config(raw, model_stage)
            talker = part.pop("_omni_talker", None)
            config = cls.from_dict(part)
            extra: dict[str, Any] = {"checkpoint_part": model_stage}
            if talker is not None:
                extra.update(
                    embedding_size=talker["embedding_size"],
                    suppress_token_ids=tuple(talker["suppress_token_ids"]),
                    emits_text=False,
                )
            return dataclasses.replace(config, **extra)
        if model_stage is not None:
            raise CheckpointError(
                f"model_stage {model_stage!r} names a part of a multi-part checkpoint; "
                f"{path} is a single model ({raw.get('model_type')!r})"
            )
        return cls.from_dict(raw)


def _dtype_name(value: Any) -> str | None:
    return value.removeprefix("torch.") if isinstance(value, str) else None


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope_config(raw: dict[str, Any]) -> RopeConfig:
    params = dict(raw.get("rope_scaling") or {})
    params.update(raw.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "mrope":  # text-only positions make multimodal RoPE the plain one
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )
