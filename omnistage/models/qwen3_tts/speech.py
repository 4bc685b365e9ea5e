"""A speech request's prompt for the talker stage, checked as vLLM-Omni's Qwen3-TTS adapter
checks it: the task is the checkpoint's variant (CustomVoice: a named voice and an optional
instruction; VoiceDesign: a voice described in words; Base: a voice cloned from a clip), the
language one the checkpoint has. The text goes in as ``assistant_text`` tokenized; the rows
are a ``prompt_spec`` the talker embeds, with as many prompt ids (the codec pad: they count
for lengths only). A clone's spec carries its clip (24 kHz float32 bytes, 53 ms to
``MAX_REF_SECONDS``) and, in context (ICL: ``ref_text``), the reference text's ids and the
clip's frame count; the code2wav stage is then told to drop those frames' samples
(``request_params``: ``audio_params.context_frames``). A ``speaker_embedding`` (vLLM-Omni's
precomputed x-vector, as wide as the talker) stands for the clip's x-vector: a clone with the
x-vector alone, no clip. As the package's ``generate_voice_clone``, a clone takes one text
token per step unless ``non_streaming_mode`` says otherwise."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from omnistage.errors import CheckpointError, InvalidRequestError
from omnistage.models.interfaces import SpeechInput
from omnistage.models.qwen3_tts.codec_encoder import frames_of
from omnistage.models.qwen3_tts.config import AUTO_LANGUAGE, served_config
from omnistage.models.qwen3_tts.prompt import (
    assistant_text,
    instruct_text,
    ref_text,
    talker_prompt,
)

# vLLM-Omni's task names -> the checkpoint's tts_model_type
TASKS = {"CustomVoice": "custom_voice", "VoiceDesign": "voice_design", "Base": "base"}
MAX_INSTRUCTIONS = 500  # characters, as vLLM-Omni bounds them
MAX_REF_SECONDS = 30.0  # a clone's clip, as vLLM-Omni bounds it
MAX_REF_TEXT = 2000  # characters of a clone's reference text
CLONE_FIELDS = ("ref_audio", "ref_text", "x_vector_only_mode", "speaker_embedding")


@functools.lru_cache(maxsize=8)
def clone_settings(folder: str) -> tuple[int, int, int]:
    """A Base checkpoint's clip rules: its rate, the fewest samples its speaker encoder takes
    and the samples per reference frame (``CheckpointError`` if its files do not say)."""
    from omnistage.models.qwen3_tts.codec_encoder import read_settings
    from omnistage.models.qwen3_tts.speaker import encoder_config

    where = Path(folder) / "config.json"
    raw = json.loads(where.read_text())
    speaker = encoder_config(raw, str(where))
    codec = read_settings(folder)
    rate = int(codec.get("input_sample_rate", 24000))
    if rate != speaker.sample_rate:
        raise CheckpointError(
            f"{folder}: the speech tokenizer takes {rate} Hz, the speaker encoder "
            f"{speaker.sample_rate} Hz (one clip feeds both)"
        )
    return rate, speaker.min_samples, int(codec.get("encode_downsample_rate", 1920))


def speech_prompt(
    folder: str, encode: Callable[[str], list[int]], speech: SpeechInput
) -> dict[str, Any]:
    config = served_config(folder)
    variant = config.variant
    checkpoint_task = next(name for name, v in TASKS.items() if v == variant)
    if speech.task_type is not None and speech.task_type not in TASKS:
        raise InvalidRequestError("task_type", f"must be one of {list(TASKS)}")
    if speech.task_type not in (None, checkpoint_task):
        raise InvalidRequestError(
            "task_type",
            f"this Qwen3-TTS checkpoint is {checkpoint_task}; it does not do {speech.task_type}",
        )
    if variant != "base":
        for name in CLONE_FIELDS:
            if getattr(speech, name) is not None:
                raise InvalidRequestError(
                    name, f"clones a voice, which a Base checkpoint does; this one is "
                    f"{checkpoint_task}"
                )  # fmt: skip
    if not speech.text.strip():
        raise InvalidRequestError("input", "must not be empty")
    instructions = speech.instructions or None
    if instructions is not None and len(instructions) > MAX_INSTRUCTIONS:
        raise InvalidRequestError("instructions", f"is longer than {MAX_INSTRUCTIONS} characters")
    if variant == "base":
        return clone_prompt(folder, encode, speech)
    speaker = None
    if variant == "custom_voice":
        speaker = (speech.voice or sorted(config.speakers)[0]).lower()
        if not config.takes_instructions:
            instructions = None  # the 0.6B CustomVoice speaks no instruction (as the package)
    elif instructions is None:
        raise InvalidRequestError("instructions", "a VoiceDesign model needs the voice described")
    elif speech.voice:
        raise InvalidRequestError("voice", "a VoiceDesign model takes its voice from instructions")
    non_streaming = True if variant == "voice_design" else speech.non_streaming_mode
    prompt = talker_prompt(
        config,
        encode(assistant_text(speech.text)),
        language=speech.language or AUTO_LANGUAGE,
        speaker=speaker,
        instruct_ids=encode(instruct_text(instructions)) if instructions else None,
        non_streaming_mode=True if non_streaming is None else non_streaming,
    )
    return {"prompt_token_ids": [config.codec.pad] * len(prompt), "prompt_spec": prompt.spec()}


def clone_prompt(
    folder: str, encode: Callable[[str], list[int]], speech: SpeechInput
) -> dict[str, Any]:
    """A Base checkpoint's prompt: the clip's x-vector in the speaker row and, unless
    ``x_vector_only_mode``, the reference text and the clip's frames in context (ICL)."""
    if speech.instructions:
        raise InvalidRequestError("instructions", "a Base model speaks no instruction")
    if speech.speaker_embedding is not None:
        return embedding_prompt(folder, encode, speech)
    if speech.ref_audio is None:
        raise InvalidRequestError(
            "ref_audio", "a Base model clones a voice: give its clip (or its speaker_embedding)"
        )
    # with a clip, a named voice is not read (as vLLM-Omni: the openai client always sends one)
    samples, rate = speech.ref_audio
    want, least, per_frame = clone_settings(folder)
    if rate != want:
        raise InvalidRequestError("ref_audio", f"must be at {want} Hz here, got {rate} Hz")
    clip = np.ascontiguousarray(samples, dtype=np.float32)
    if clip.ndim != 1 or not np.isfinite(clip).all():
        raise InvalidRequestError("ref_audio", "must be finite mono samples")
    if len(clip) < least:
        raise InvalidRequestError(
            "ref_audio", f"is {len(clip) / rate * 1000:.0f} ms: the speaker encoder needs at "
            f"least {least} samples ({least / rate * 1000:.0f} ms)"
        )  # fmt: skip
    if len(clip) > MAX_REF_SECONDS * rate:
        raise InvalidRequestError(
            "ref_audio", f"is {len(clip) / rate:.1f} s, longer than the {MAX_REF_SECONDS:g} s a "
            "reference clip may be"
        )  # fmt: skip
    x_vector_only = bool(speech.x_vector_only_mode)
    reference = (speech.ref_text or "").strip()
    if not x_vector_only and not reference:
        raise InvalidRequestError(
            "ref_text", "a clone in context needs the clip's transcript (or x_vector_only_mode)"
        )
    if len(speech.ref_text or "") > MAX_REF_TEXT:
        raise InvalidRequestError("ref_text", f"is longer than {MAX_REF_TEXT} characters")
    frames = 0 if x_vector_only else frames_of(len(clip), per_frame)
    non_streaming = speech.non_streaming_mode
    prompt = talker_prompt(
        served_config(folder),
        encode(assistant_text(speech.text)),
        language=speech.language or AUTO_LANGUAGE,
        speaker_vector=True,
        non_streaming_mode=False if non_streaming is None else non_streaming,
        ref_ids=None if x_vector_only else encode(ref_text(speech.ref_text or "")),
        ref_frames=frames,
    )
    if frames and not prompt.ref_ids:
        raise InvalidRequestError("ref_text", "says nothing (no tokens between its markers)")
    spec = {**prompt.spec(), "ref_audio": clip.astype("<f4").tobytes()}
    out: dict[str, Any] = {
        "prompt_token_ids": [served_config(folder).codec.pad] * len(prompt),
        "prompt_spec": spec,
    }
    if frames:  # the code2wav stage drops the reference's samples
        out["request_params"] = {"audio_params": {"context_frames": frames}}
    return out


def embedding_prompt(
    folder: str, encode: Callable[[str], list[int]], speech: SpeechInput
) -> dict[str, Any]:
    """A clone from a given x-vector (``speaker_embedding``): the speaker row is that vector,
    as wide as the talker; no clip, so no reference frames and no transcript."""
    if speech.ref_audio is not None:
        raise InvalidRequestError(
            "speaker_embedding", "stands for the clip's x-vector: give it or ref_audio, not both"
        )
    if speech.ref_text is not None:
        raise InvalidRequestError(
            "ref_text", "a speaker_embedding clones with the x-vector alone: no transcript"
        )
    if speech.x_vector_only_mode is False:
        raise InvalidRequestError(
            "x_vector_only_mode", "a speaker_embedding clones with the x-vector alone: true"
        )
    config = served_config(folder)
    vector = np.asarray(speech.speaker_embedding, dtype=np.float64)
    width = embedding_width(folder)
    if vector.shape != (width,):
        raise InvalidRequestError(
            "speaker_embedding", f"has {vector.size} values; this checkpoint's x-vector has {width}"
        )
    if not np.isfinite(vector).all() or np.abs(vector).max() > np.finfo(np.float32).max:
        raise InvalidRequestError("speaker_embedding", "must be finite float32 values")
    non_streaming = speech.non_streaming_mode
    prompt = talker_prompt(
        config,
        encode(assistant_text(speech.text)),
        language=speech.language or AUTO_LANGUAGE,
        speaker_vector=True,
        non_streaming_mode=False if non_streaming is None else non_streaming,
    )
    spec = {**prompt.spec(), "speaker_embedding": vector.astype("<f4").tobytes()}
    return {"prompt_token_ids": [config.codec.pad] * len(prompt), "prompt_spec": spec}


@functools.lru_cache(maxsize=8)
def embedding_width(folder: str) -> int:
    """How many values a Base checkpoint's x-vector has (its speaker encoder's output)."""
    from omnistage.models.qwen3_tts.speaker import encoder_config

    where = Path(folder) / "config.json"
    return int(encoder_config(json.loads(where.read_text()), str(where)).enc_dim)
