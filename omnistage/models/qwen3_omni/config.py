"""Qwen3-Omni's ``config.json`` (``model_type: qwen3_omni_moe``): one folder, three parts, each
served by its own stage.

The ``thinker`` is a Qwen3-MoE text decoder (per-head q/k RMSNorm, ``num_experts`` experts of
``moe_intermediate_size`` features in every ``decoder_sparse_step``-th layer but
``mlp_only_layers``, top-k renormalised with ``norm_topk_prob``) with interleaved multimodal
rotary positions (``rope_parameters.mrope_section`` with ``interleaved``), plus an audio
encoder and a Qwen3-VL-style vision encoder whose DeepStack features are added to the
decoder's first hidden states (``encoders``). The ``talker`` and ``code2wav`` are read by
their own modules. A stage says which part it runs with ``model_stage``.

Besides the decoder's config this module reads the special token ids the thinker's prompt
processor and the thinker → talker hand-off need (``OmniTokens``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omnistage.errors import CheckpointError
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.omni_family import Checkpoint

MODEL_TYPE = "qwen3_omni_moe"
FAMILY_NAME = "qwen3_omni"
ENCODER_CONFIGS = ("audio_config", "vision_config")


CHECKPOINT = Checkpoint(MODEL_TYPE, "Qwen3-Omni")
read_config = CHECKPOINT.read_config  # the folder's config.json if it is one, else None


def _section(raw: dict[str, Any], name: str) -> dict[str, Any]:
    value = raw.get(name)
    if not isinstance(value, dict) or not value:
        raise CheckpointError(f"config.json has no {name}")
    return value


def encoder_configs(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The thinker's audio and vision encoder configs (``ARModelConfig.extras`` of the thinker:
    its ``build_decoder`` builds the encoders from them)."""
    thinker = _section(raw, "thinker_config")
    return {name: dict(_section(thinker, name)) for name in ENCODER_CONFIGS}


def thinker_config(raw: dict[str, Any]) -> ARModelConfig:
    """The thinker's text decoder, a Qwen3-MoE decoder with interleaved multimodal RoPE; its
    encoders' configs in ``extras``."""
    from omnistage.models.qwen3_moe import layout as moe_layout

    thinker = _section(raw, "thinker_config")
    sub = dict(_section(thinker, "text_config"))
    sub.setdefault("torch_dtype", raw.get("torch_dtype") or raw.get("dtype"))
    # transformers ties the thinker's LM head by the thinker config's flag, not the text one's.
    if "tie_word_embeddings" in thinker:
        sub["tie_word_embeddings"] = thinker["tie_word_embeddings"]
    config = ARModelConfig.from_hf(
        sub,
        family=FAMILY_NAME,
        part="thinker",
        extras=encoder_configs(raw),
        **moe_layout(sub),
    )
    rope = config.rope
    if len(rope.mrope_section) != 3 or not rope.mrope_interleaved:
        raise CheckpointError(
            "thinker_config.text_config.rope_parameters must give three mrope_section values "
            f"with interleaved: true (got {list(rope.mrope_section)}, "
            f"interleaved={rope.mrope_interleaved})"
        )
    return config


def _int(section: dict[str, Any], key: str, where: str) -> int:
    try:
        return int(section[key])
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(f"config.json: {where}{key} is missing or not an integer") from None


@dataclass(frozen=True)
class OmniTokens:
    """The special ids of the thinker's prompts and of the thinker → talker hand-off.

    ``audio_end`` and ``vision_end`` are only in newer configs (transformers reads the
    tokenizer's ``<|audio_end|>`` / ``<|vision_end|>``): None when the config lacks them."""

    audio: int
    image: int
    video: int
    audio_start: int
    vision_start: int
    audio_end: int | None
    vision_end: int | None
    im_start: int
    im_end: int
    system: int
    user: int
    assistant: int
    tts_pad: int
    tts_bos: int
    tts_eos: int
    position_id_per_seconds: float
    seconds_per_chunk: float
    spatial_merge_size: int
    audio_n_window: int

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> OmniTokens:
        thinker = _section(raw, "thinker_config")
        vision = thinker.get("vision_config") or {}
        audio = thinker.get("audio_config") or {}
        t = "thinker_config."

        def optional(key: str) -> int | None:
            return None if thinker.get(key) is None else _int(thinker, key, t)

        try:
            per_second = float(thinker.get("position_id_per_seconds", 25))
            per_chunk = float(thinker.get("seconds_per_chunk", 2))
        except (TypeError, ValueError):
            raise CheckpointError(
                "config.json: thinker_config.position_id_per_seconds / seconds_per_chunk "
                "must be numbers"
            ) from None
        return cls(
            audio=_int(thinker, "audio_token_id", t),
            image=_int(thinker, "image_token_id", t),
            video=_int(thinker, "video_token_id", t),
            audio_start=_int(thinker, "audio_start_token_id", t),
            vision_start=_int(thinker, "vision_start_token_id", t),
            audio_end=optional("audio_end_token_id"),
            vision_end=optional("vision_end_token_id"),
            im_start=_int(raw, "im_start_token_id", ""),
            im_end=_int(raw, "im_end_token_id", ""),
            system=_int(raw, "system_token_id", ""),
            user=_int(raw, "user_token_id", ""),
            assistant=_int(raw, "assistant_token_id", ""),
            tts_pad=_int(raw, "tts_pad_token_id", ""),
            tts_bos=_int(raw, "tts_bos_token_id", ""),
            tts_eos=_int(raw, "tts_eos_token_id", ""),
            position_id_per_seconds=per_second,
            seconds_per_chunk=per_chunk,
            spatial_merge_size=int(vision.get("spatial_merge_size", 2)),
            audio_n_window=int(audio.get("n_window", 50)),
        )
