"""Qwen3-TTS's hand-off: the talker's frames (flat, every codebook) up to its codec end, as the
code2wav stage takes them."""

from __future__ import annotations

from typing import Any

from omnistage.errors import InvalidRequestError
from omnistage.models.processors import InputProcessor, UpstreamResult
from omnistage.models.qwen3_omni.processors import whole_frames
from omnistage.models.qwen3_tts.config import served_config


def talker_to_code2wav(upstream: UpstreamResult, folder: str) -> dict[str, Any]:
    tts = served_config(folder)
    codes, _ = whole_frames(list(upstream.token_ids), tts.num_code_groups, tts.codec.eos)
    if not codes:
        raise InvalidRequestError("sampling_params", "the talker produced no speech codes")
    return {"codes": codes}


TALKER_TO_CODE2WAV = InputProcessor(talker_to_code2wav)
