"""A Qwen3-TTS checkpoint's settings, read from its files: the variant, speakers and languages
(``config.json``), the sampling defaults (``generation_config.json``) and the speech tokenizer's
rates (``speech_tokenizer/config.json``). Plain JSON: no model code loads. Missing keys take the
official ``qwen-tts`` package's defaults; a value of the wrong type is a ``CheckpointError``
naming the key."""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omnistage.errors import CheckpointError

MODEL_TYPE = "qwen3_tts"
TOKENIZER_MODEL_TYPE = "qwen3_tts_tokenizer_12hz"
VARIANTS = ("custom_voice", "voice_design", "base")
AUTO_LANGUAGE = "auto"  # the talker picks no language: its prefix says so (nothink)

# The reference's defaults where a checkpoint leaves a key out (Qwen3TTSConfig and
# Qwen3TTSTalkerConfig in qwen-tts; the text ids are the Qwen2 tokenizer's).
_TEXT_IDS = {
    "im_start_token_id": 151644,
    "im_end_token_id": 151645,
    "tts_pad_token_id": 151671,
    "tts_bos_token_id": 151672,
    "tts_eos_token_id": 151673,
}
_CODEC_IDS = {
    "codec_eos_token_id": 4198,
    "codec_think_id": 4202,
    "codec_nothink_id": 4203,
    "codec_think_bos_id": 4204,
    "codec_think_eos_id": 4205,
    "codec_pad_id": 4196,
    "codec_bos_id": 4197,
}
# Qwen3TTSModel's sampling defaults, under generation_config.json's and a request's own.
SAMPLING_DEFAULTS: dict[str, Any] = {
    "do_sample": True,
    "top_k": 50,
    "top_p": 1.0,
    "temperature": 0.9,
    "repetition_penalty": 1.05,
    "subtalker_dosample": True,
    "subtalker_top_k": 50,
    "subtalker_top_p": 1.0,
    "subtalker_temperature": 0.9,
    "max_new_tokens": 2048,
}


@dataclass(frozen=True)
class TextIds:
    """The text tokens the talker's prompt is built of (role markers, and the TTS pad, bos,
    eos rows added to the codec rows)."""

    im_start: int
    im_end: int
    tts_pad: int
    tts_bos: int
    tts_eos: int


@dataclass(frozen=True)
class CodecIds:
    """The talker's special codec ids (its first code of a frame is a codebook code or
    ``eos``; the others open its prompt)."""

    eos: int
    think: int
    nothink: int
    think_bos: int
    think_eos: int
    pad: int
    bos: int


@dataclass(frozen=True)
class TTSConfig:
    """What serving a Qwen3-TTS checkpoint needs to know before a model loads."""

    variant: str  # "custom_voice", "voice_design" or "base"
    model_size: str | None  # "0b6", "1b7" (the 0.6B CustomVoice takes no instruction)
    speakers: Mapping[str, int]  # name (lower case) -> its codec-embedding row
    dialects: Mapping[str, str]  # speaker -> the dialect language it speaks by default
    languages: Mapping[str, int]  # language (lower case) -> its codec id
    text: TextIds
    codec: CodecIds
    num_code_groups: int  # codes per frame (one per codebook)
    vocab_size: int  # the talker's codec vocabulary (codebook codes, then 1024 specials)
    hidden_size: int
    sampling: Mapping[str, Any]  # the reference's defaults under generation_config.json's
    sample_rate: int
    samples_per_frame: int

    @property
    def codebook_size(self) -> int:
        """Codes a frame's first code may take (the rest of the vocabulary is specials)."""
        return self.vocab_size - 1024

    @property
    def language_names(self) -> list[str]:
        """The languages a request may name: ``auto`` and the checkpoint's (not dialects)."""
        return [AUTO_LANGUAGE, *(n for n in self.languages if "dialect" not in n)]

    @property
    def takes_instructions(self) -> bool:
        """Whether the variant speaks as an instruction says (the 0.6B CustomVoice does not)."""
        return not (self.variant == "custom_voice" and self.model_size == "0b6")


def _read_json(path: Path, required: bool = True) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        if not required:
            return {}
        raise CheckpointError(f"{path} is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} cannot be read: {exc}") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    return raw


def _int(section: Mapping[str, Any], key: str, where: str, default: int | None = None) -> int:
    value = section.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointError(f"{where}: {key} must be an integer, got {value!r}")
    return value


def _ids(section: Mapping[str, Any], key: str, where: str) -> dict[str, int]:
    value = section.get(key) or {}
    if not isinstance(value, dict) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value.values()
    ):
        raise CheckpointError(f"{where}: {key} must map names to codec ids, got {value!r}")
    return {str(k).lower(): v for k, v in value.items()}


def checkpoint_text_ids(raw: Mapping[str, Any]) -> TextIds:
    """The text special ids of a ``config.json`` (the reference's defaults where absent)."""
    return TextIds(*(_int(raw, k, "config.json", d) for k, d in _TEXT_IDS.items()))


def checkpoint_codec_ids(raw: Mapping[str, Any]) -> CodecIds:
    """The talker's special codec ids of a ``config.json``."""
    talker = raw.get("talker_config") or {}
    where = "config.json: talker_config"
    return CodecIds(*(_int(talker, k, where, d) for k, d in _CODEC_IDS.items()))


def checkpoint_sampling(folder: str | Path | None) -> dict[str, Any]:
    """The package's sampling defaults under ``folder``'s ``generation_config.json`` (the
    defaults alone without a folder)."""
    generation = _read_json(Path(folder) / "generation_config.json", False) if folder else {}
    return {**SAMPLING_DEFAULTS, **{k: v for k, v in generation.items() if k in SAMPLING_DEFAULTS}}


def is_tts_checkpoint(folder: str | Path) -> bool:
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(raw, dict) and raw.get("model_type") == MODEL_TYPE


def read_config(folder: str | Path) -> TTSConfig:
    """The checkpoint's settings (``CheckpointError`` naming the file and key otherwise)."""
    folder = Path(folder)
    where = str(folder / "config.json")
    raw = _read_json(folder / "config.json")
    if raw.get("model_type") != MODEL_TYPE:
        raise CheckpointError(f"{folder} is not a Qwen3-TTS checkpoint (model_type {MODEL_TYPE!r})")
    variant = raw.get("tts_model_type")
    if variant not in VARIANTS:
        raise CheckpointError(
            f"{where}: tts_model_type must be one of {list(VARIANTS)}, got {variant!r}"
        )
    talker = raw.get("talker_config")
    if not isinstance(talker, dict):
        raise CheckpointError(f"{where}: talker_config is missing")
    talker_where = f"{where}: talker_config"
    speakers = _ids(talker, "spk_id", talker_where)
    dialect_of = talker.get("spk_is_dialect") or {}
    if not isinstance(dialect_of, dict):
        raise CheckpointError(f"{talker_where}: spk_is_dialect must map speakers to a dialect")
    languages = _ids(talker, "codec_language_id", talker_where)
    dialects = {str(k).lower(): str(v).lower() for k, v in dialect_of.items() if v}
    unknown = sorted(d for d in dialects.values() if d not in languages)
    if unknown:
        raise CheckpointError(
            f"{talker_where}: spk_is_dialect names {unknown}, not in codec_language_id"
        )
    tokenizer = _read_json(folder / "speech_tokenizer" / "config.json")
    tokenizer_where = str(folder / "speech_tokenizer" / "config.json")
    if tokenizer.get("model_type") != TOKENIZER_MODEL_TYPE:
        raise CheckpointError(
            f"{tokenizer_where}: model_type must be {TOKENIZER_MODEL_TYPE!r} (the 12 Hz tokenizer), "
            f"got {tokenizer.get('model_type')!r}"
        )
    return TTSConfig(
        variant=variant,
        model_size=raw.get("tts_model_size"),
        speakers=speakers,
        dialects=dialects,
        languages=languages,
        text=TextIds(*(_int(raw, k, where, d) for k, d in _TEXT_IDS.items())),
        codec=CodecIds(*(_int(talker, k, talker_where, d) for k, d in _CODEC_IDS.items())),
        num_code_groups=_int(talker, "num_code_groups", talker_where, 32),
        vocab_size=_int(talker, "vocab_size", talker_where, 3072),
        hidden_size=_int(talker, "hidden_size", talker_where, 1024),
        sampling=checkpoint_sampling(folder),
        sample_rate=_int(tokenizer, "output_sample_rate", tokenizer_where, 24000),
        samples_per_frame=_int(tokenizer, "decode_upsample_rate", tokenizer_where, 1920),
    )


@functools.lru_cache(maxsize=8)
def served_config(folder: str) -> TTSConfig:
    """``read_config`` once per folder, for what runs per request (a served checkpoint's files
    do not change under it; a weight update changes weights only)."""
    return read_config(folder)
