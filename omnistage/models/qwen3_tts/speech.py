"""A speech request's prompt for the talker stage, checked as vLLM-Omni's Qwen3-TTS adapter
checks it: the task is the checkpoint's variant (CustomVoice: a named voice and an optional
instruction; VoiceDesign: a voice described in words), the language one the checkpoint has.
The text goes in as ``assistant_text`` tokenized; the rows are a ``prompt_spec`` the talker
embeds, with as many prompt ids (the codec pad: they count for lengths only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from omnistage.errors import InvalidRequestError
from omnistage.models.interfaces import SpeechInput
from omnistage.models.qwen3_tts.config import AUTO_LANGUAGE, served_config
from omnistage.models.qwen3_tts.prompt import assistant_text, instruct_text, talker_prompt

# vLLM-Omni's task names -> the checkpoint's tts_model_type
TASKS = {"CustomVoice": "custom_voice", "VoiceDesign": "voice_design", "Base": "base"}
MAX_INSTRUCTIONS = 500  # characters, as vLLM-Omni bounds them


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
    if variant == "base":
        raise InvalidRequestError(
            "task_type", "voice cloning (a Base checkpoint) is not served yet: use a "
            "CustomVoice or VoiceDesign checkpoint"
        )  # fmt: skip
    if not speech.text.strip():
        raise InvalidRequestError("input", "must not be empty")
    instructions = speech.instructions or None
    if instructions is not None and len(instructions) > MAX_INSTRUCTIONS:
        raise InvalidRequestError("instructions", f"is longer than {MAX_INSTRUCTIONS} characters")
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
