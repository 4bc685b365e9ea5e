"""The configuration of a decoder (``omnistage.models.decoder``), read from an HF-layout
``config.json`` by the checkpoint's model family (``omnistage.models.registry``).

One frozen dataclass covers every registered decoder family: the family's mapping sets its
layout (Qwen2's q/k/v bias, Qwen3's per-head q/k RMSNorm, Llama's optional biases) and, for a
mixture-of-experts decoder, its experts. Both the transformers-4 keys (``rope_theta`` +
``rope_scaling``) and the transformers-5 ``rope_parameters`` are understood.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omnistage.errors import CheckpointError
from omnistage.models.tp_plan import DENSE_PLAN, TPPlan

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # Multimodal RoPE (Qwen2-VL's mRoPE, Qwen2.5-Omni's TMRoPE): the rotary frequencies split
    # into sections (in pairs of head dims) turned by the time, height and width positions.
    mrope_section: tuple[int, ...] = ()
    # Interleaved mRoPE (Qwen3-VL, Qwen3-Omni): frequency ``j`` turns by the height position
    # when ``j % 3 == 1`` and ``j < 3 * section[1]``, by the width one when ``j % 3 == 2``
    # and ``j < 3 * section[2]``, else by the time one (instead of contiguous sections).
    mrope_interleaved: bool = False


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
    family: str = "qwen2"  # the registry's name of the family that reads the checkpoint
    # A part of a multi-part checkpoint (the family names them: "thinker", "talker"), else None.
    part: str | None = None
    # Input embeddings of another width, projected to hidden_size (a stage fed by another's).
    embedding_size: int | None = None
    suppress_token_ids: tuple[int, ...] = ()  # never sampled
    # Codes per step: a model with several codebooks samples the first from its logits and
    # predicts the others (``predict_frame``); its stage emits each step's whole frame.
    code_groups: int = 1
    # The width of the input embeddings a request gives when the model projects them itself
    # (``project_embeds``); None: ``embedding_size``.
    inputs_embeds_size: int | None = None
    emits_text: bool = True  # False: the tokens are codes, not text (no detokenizing)
    # Mixture of experts: layer ``i`` runs experts when ``num_experts`` and
    # ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in ``mlp_only_layers``.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # A shared expert beside the routed ones (Qwen2-MoE, the Qwen3-Omni talker): a gated MLP
    # of this many features every token runs, scaled by ``sigmoid(shared_expert_gate(x))``.
    shared_expert_intermediate_size: int = 0
    tp_plan: TPPlan = DENSE_PLAN
    # What the family needs beyond the shared decoder (the Qwen2.5-Omni thinker's encoder
    # configs): read by its ``build_decoder`` only; plain JSON values; not part of the hash.
    extras: Mapping[str, Any] = field(default_factory=dict, hash=False)

    @property
    def num_kv_groups(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def uses_experts(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` runs experts instead of its dense MLP."""
        return (
            self.num_experts > 0
            and (layer + 1) % self.decoder_sparse_step == 0
            and layer not in self.mlp_only_layers
        )

    @classmethod
    def from_hf(cls, raw: dict[str, Any], **layout: Any) -> ARModelConfig:
        """Validate an HF decoder config dict; ``layout`` (``family``, ``qkv_bias``,
        ``qk_norm``, ...) is what the checkpoint's family knows of its layers. Raises
        ``CheckpointError`` naming what is unsupported."""
        if raw.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"hidden_act {raw['hidden_act']!r} is not supported (only silu)")
        if raw.get("use_sliding_window"):
            raise CheckpointError("use_sliding_window=true is not supported")
        try:
            hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
            kv_heads = int(raw.get("num_key_value_heads") or heads)
            config = cls(
                model_type=str(raw.get("model_type")),
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
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=_as_ids(raw.get("eos_token_id")),
                # transformers 5 writes "dtype", 4 "torch_dtype".
                torch_dtype=_dtype_name(raw.get("dtype") or raw.get("torch_dtype")),
                **layout,
            )
        except KeyError as exc:
            raise CheckpointError(f"config.json lacks required key {exc.args[0]!r}") from exc
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"config.json has an invalid value: {exc}") from exc
        if heads % kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads ({kv_heads})"
            )
        if config.num_experts and not 0 < config.num_experts_per_tok <= config.num_experts:
            raise CheckpointError(
                f"num_experts_per_tok ({config.num_experts_per_tok}) must be in "
                f"[1, num_experts={config.num_experts}]"
            )
        return config

    @classmethod
    def from_pretrained(cls, path: str | Path, model_stage: str | None = None) -> ARModelConfig:
        """The decoder config of the checkpoint in ``path``, read by its family; for a
        multi-part checkpoint, of the part ``model_stage`` names."""
        from omnistage.models import registry

        raw = read_config_json(path)
        raw.setdefault("_name_or_path", str(path))  # where it was read, as transformers keeps it
        return registry.as_ar(registry.family_of(raw, path), path).decoder_config(raw, model_stage)


def read_config_json(path: str | Path) -> dict[str, Any]:
    file = Path(path) / "config.json"
    if not file.is_file():
        raise CheckpointError(f"no config.json in {path}")
    return read_json_object(file)


def read_json_object(file: Path) -> dict[str, Any]:
    """A checkpoint's JSON file that must hold an object (``CheckpointError`` otherwise)."""
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"cannot read {file}: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{file} must hold a JSON object")
    return raw


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
    if rope_type == "mrope":  # multimodal RoPE over the default frequencies
        rope_type = "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise CheckpointError(
            f"rope type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}"
        )
    sections = tuple(int(s) for s in params.get("mrope_section") or ())
    interleaved = bool(params.get("mrope_interleaved", params.get("interleaved", False)))
    if rope_type == "default":
        return RopeConfig(theta=theta, mrope_section=sections, mrope_interleaved=interleaved)
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
