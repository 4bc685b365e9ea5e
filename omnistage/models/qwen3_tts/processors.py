"""Qwen3-TTS's hand-off: the talker's frames (flat, every codebook) up to its codec end, as the
code2wav stage takes them — whole (``talker_to_code2wav``: the talker's finished output, as
``serve --no-stream`` hands it over) or as they come (``TalkerFrames``: the pipeline's
``stream: true`` edge, whole frames only, ending at the codec end)."""

from __future__ import annotations

from typing import Any

from omnistage.errors import InvalidRequestError
from omnistage.models.processors import InputProcessor, UpstreamResult
from omnistage.models.qwen3_omni.processors import CodecFrames, whole_frames
from omnistage.models.qwen3_tts.config import served_config

FIELD = "sampling_params"  # where a request sets the talker's sampling (its max_tokens)


def talker_to_code2wav(upstream: UpstreamResult, folder: str) -> dict[str, Any]:
    tts = served_config(folder)
    codes, _ = whole_frames(list(upstream.token_ids), tts.num_code_groups, tts.codec.eos)
    if not codes:
        raise InvalidRequestError(FIELD, "the talker produced no speech codes")
    return {"codes": codes}


class TalkerFrames(CodecFrames):
    """The talker's frames as they come: the streamed form of ``talker_to_code2wav``."""

    def __init__(self, folder: str) -> None:
        tts = served_config(folder)
        super().__init__(tts.num_code_groups, tts.codec.eos, FIELD)


TALKER_TO_CODE2WAV = InputProcessor(talker_to_code2wav, stream=TalkerFrames)
