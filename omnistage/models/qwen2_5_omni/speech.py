"""Qwen2.5-Omni speaking a given text (``/v1/audio/speech``, ``omni_speech``): the system
turn its model card asks for speech output (transformers warns that audio may not work
without it), its thinker's end of turn, and the voices of ``spk_dict.pt``."""

from __future__ import annotations

from omnistage.models.omni_speech import QWEN_SYSTEM_PROMPT, OmniSpeech


def voices(folder: str) -> list[str]:
    from omnistage.models.qwen2_5_omni.processors import checkpoint_tokens

    return sorted(checkpoint_tokens(folder)[1])


SPEECH = OmniSpeech(QWEN_SYSTEM_PROMPT, "<|im_end|>", voices)
