"""Qwen2.5-Omni's ``config.json``: one folder, three parts, each served by its own stage.

A Hugging Face Qwen2.5-Omni folder (``model_type: qwen2_5_omni``) holds the ``thinker`` (a
Qwen2 text decoder, plus audio and vision encoders: ``encoders``), the ``talker`` (a Qwen2
decoder over speech-codec tokens whose inputs are the thinker's embeddings and hidden states,
projected by ``thinker_to_talker_proj``) and ``token2wav`` (a flow-matching DiT and a BigVGAN
vocoder). A stage says which part it runs with ``model_stage``.

Both decoders run as Qwen2 decoders with multimodal rotary positions (TMRoPE, sections
``mrope_section``): a prompt with audio, pictures or video brings its 3-D positions
(``rope_index``); a text-only prompt takes 0, 1, 2, ... in all three rows, which is exactly
the ordinary rotary embedding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from omnistage.errors import CheckpointError
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.omni_family import Checkpoint

MODEL_TYPE = "qwen2_5_omni"
FAMILY_NAME = "qwen2_5_omni"
AR_PARTS = ("thinker", "talker")
PARTS = ("thinker", "talker", "code2wav")


CHECKPOINT = Checkpoint(MODEL_TYPE, "Qwen2.5-Omni")
read_config = CHECKPOINT.read_config  # the folder's config.json if it is one, else None


@dataclass(frozen=True)
class TalkerTokens:
    """The talker's special ids: codec ids (its own vocabulary) and the thinker-vocabulary
    ids whose embeddings frame the reply it speaks."""

    codec_bos: int
    codec_eos: int
    codec_pad: int
    codec_mask: int
    text_bos: int
    text_eos: int
    text_pad: int

    @classmethod
    def from_config(cls, raw: dict[str, Any]) -> TalkerTokens:
        talker = raw.get("talker_config") or {}
        try:
            return cls(
                codec_bos=int(talker["tts_codec_start_token_id"]),
                codec_eos=int(talker["tts_codec_end_token_id"]),
                codec_pad=int(talker["tts_codec_pad_token_id"]),
                codec_mask=int(talker["tts_codec_mask_token_id"]),
                text_bos=int(talker["tts_text_start_token_id"]),
                text_eos=int(talker["tts_text_end_token_id"]),
                text_pad=int(talker["tts_text_pad_token_id"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"talker_config lacks a valid token id: {exc}") from None


def decoder_config(raw: dict[str, Any], part: str | None) -> ARModelConfig:
    """The decoder of the thinker (its text model) or of the talker, as Qwen2 decoders."""
    if part not in AR_PARTS:
        raise CheckpointError(
            f"model_stage: a Qwen2.5-Omni checkpoint's decoder parts are {list(AR_PARTS)}, "
            f"got {part!r}"
        )
    if part == "thinker":
        sub = dict((raw.get("thinker_config") or {}).get("text_config") or {})
    else:
        sub = dict(raw.get("talker_config") or {})
    if not sub:
        raise CheckpointError(f"config.json has no {part} configuration")
    sub.setdefault("torch_dtype", raw.get("torch_dtype") or raw.get("dtype"))
    layout: dict[str, Any] = {"family": FAMILY_NAME, "part": part, "qkv_bias": True}
    if part == "thinker":
        layout["extras"] = encoder_configs(raw)
    if part == "talker":
        tokens = TalkerTokens.from_config(raw)
        layout.update(
            embedding_size=int(sub.get("embedding_size") or sub["hidden_size"]),
            suppress_token_ids=(tokens.codec_bos,),
            emits_text=False,
        )
    return ARModelConfig.from_hf(sub, **layout)


ENCODER_CONFIGS = ("audio_config", "vision_config")


def encoder_configs(raw: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The thinker's audio and vision encoder configs (``ARModelConfig.extras`` of the thinker:
    its ``build_decoder`` builds the encoders from them)."""
    thinker = raw.get("thinker_config") or {}
    configs: dict[str, dict[str, Any]] = {}
    for name in ENCODER_CONFIGS:
        value = thinker.get(name)
        if not isinstance(value, dict) or not value:
            raise CheckpointError(f"config.json has no thinker_config.{name}")
        configs[name] = value
    return configs
