"""Qwen3-Omni speaking a given text (``/v1/audio/speech``, ``omni_speech``): the system turn
Qwen's omni examples give for speech output, its thinker's end of turn, and the talker's
speakers (``talker_config.speaker_id``, lower case as transformers takes them)."""

from __future__ import annotations

from omnistage.models.omni_speech import QWEN_SYSTEM_PROMPT, OmniSpeech


def voices(folder: str) -> list[str]:
    from omnistage.models.qwen3_omni.processors import checkpoint_tokens

    return sorted(checkpoint_tokens(folder)[1].voices)


SPEECH = OmniSpeech(QWEN_SYSTEM_PROMPT, "<|im_end|>", voices)
