"""Qwen2.5-Omni checkpoints: one folder, three parts, each served by its own stage.

A Hugging Face Qwen2.5-Omni folder (``config.json`` with ``model_type: qwen2_5_omni``) holds
the ``thinker`` (a Qwen2 text decoder, plus audio and vision encoders omnistage does not run
yet), the ``talker`` (a Qwen2 decoder over speech-codec tokens whose inputs are the thinker's
embeddings and hidden states, projected by ``thinker_to_talker_proj``) and ``token2wav`` (a
flow-matching DiT and a BigVGAN vocoder), with weights named ``thinker.*``, ``talker.*`` and
``token2wav.*`` and the voices in ``spk_dict.pt``. A stage says which part it runs with
``model_stage``; it maps (and so reads) only its own part's tensors.

Text-only prompts take positions 0, 1, 2, ... in all three rows of the multimodal rotary
embedding (mRoPE), which makes it exactly the ordinary rotary embedding: both decoders run as
qwen2-family models.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.errors import CheckpointError

MODEL_TYPE = "qwen2_5_omni"
AR_PARTS = ("thinker", "talker")
PARTS = ("thinker", "talker", "code2wav")
SPEAKERS_FILE = "spk_dict.pt"


def read_config(folder: str | Path) -> dict[str, Any] | None:
    """The folder's ``config.json`` if it is a Qwen2.5-Omni checkpoint, else None."""
    file = Path(folder) / "config.json"
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError):
        return None
    return raw if isinstance(raw, dict) and raw.get("model_type") == MODEL_TYPE else None


def is_qwen_omni(folder: str | Path) -> bool:
    return read_config(folder) is not None


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


def ar_part_config(raw: dict[str, Any], part: str | None) -> dict[str, Any]:
    """The qwen2-family config dict of the thinker's text decoder or of the talker."""
    if part not in AR_PARTS:
        raise CheckpointError(
            f"model_stage: a Qwen2.5-Omni checkpoint's AR parts are {list(AR_PARTS)}, got {part!r}"
        )
    if part == "thinker":
        sub = dict((raw.get("thinker_config") or {}).get("text_config") or {})
    else:
        sub = dict(raw.get("talker_config") or {})
    if not sub:
        raise CheckpointError(f"config.json has no {part} configuration")
    sub["model_type"] = "qwen2"  # Qwen2 decoder layers: q/k/v bias, no o bias
    sub.setdefault("torch_dtype", raw.get("torch_dtype") or raw.get("dtype"))
    if part == "talker":
        tokens = TalkerTokens.from_config(raw)
        sub["_omni_talker"] = {
            "embedding_size": int(sub.get("embedding_size") or sub["hidden_size"]),
            "suppress_token_ids": [tokens.codec_bos],
        }
    return sub


def ar_rename(part: str) -> Callable[[str], str | None]:
    """Checkpoint name → the qwen2-family module's name, for ``part``'s tensors only."""
    prefix = f"{part}."
    heads = {"thinker": {"lm_head.": "lm_head."}, "talker": {"codec_head.": "lm_head."}}[part]
    extra = {"talker": {"thinker_to_talker_proj.": "input_proj."}}.get(part, {})

    def rename(name: str) -> str | None:
        if not name.startswith(prefix) or name.endswith("rotary_emb.inv_freq"):
            return None
        rest = name[len(prefix) :]
        if rest.startswith("model."):
            # The thinker's audio/vision encoders live beside ``model.`` and are not served.
            return rest
        for table in (heads, extra):
            for src, dst in table.items():
                if rest.startswith(src):
                    return dst + rest[len(src) :]
        return None

    return rename


DEFAULT_VOICE = "Chelsie"  # transformers' default speaker


def default_voice(voices: list[str]) -> str:
    return DEFAULT_VOICE if DEFAULT_VOICE in voices else voices[0]


def load_speakers(folder: str | Path) -> dict[str, dict[str, Any]]:
    """``spk_dict.pt``: per voice ``cond``, ``ref_mel`` and ``bos_token`` (loaded with
    ``weights_only=True``: tensors and plain values only, never code)."""
    import torch

    path = Path(folder) / SPEAKERS_FILE
    try:
        speakers = torch.load(path, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"no {SPEAKERS_FILE} (the voices) in {folder}") from None
    except Exception as exc:
        raise CheckpointError(f"cannot read {path}: {type(exc).__name__}: {exc}") from None
    if not isinstance(speakers, dict) or not speakers:
        raise CheckpointError(f"{path} holds no voices")
    for name, entry in speakers.items():
        if not isinstance(entry, dict) or not {"cond", "ref_mel", "bos_token"} <= set(entry):
            raise CheckpointError(f"{path}: voice {name!r} lacks cond, ref_mel or bos_token")
    return speakers


def voice_bos_tokens(folder: str | Path) -> dict[str, int]:
    """Each voice's text bos id (what the talker's reply starts with)."""
    return {str(name): int(entry["bos_token"]) for name, entry in load_speakers(folder).items()}
