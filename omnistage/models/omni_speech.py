"""An omni model speaking a given text (``/v1/audio/speech``), as the Qwen omni families share it:
the thinker *says* the text and the talker speaks what it says.

The prompt is a chat the thinker's template renders (a system turn, then a user turn asking
to read a text aloud: the text itself is not in it), and the thinker's reply is forced to the
text's tokens and its end of turn (``forced_token_ids``: computed step by step as drawn ones,
so the talker and the vocoder get exactly what a chat whose reply is that text gives them).
The request's sampling is the talker's (``sampling_params_for``); the voice goes where a
chat's goes (``audio_params.voice``, through ``request_params``). A family gives its system
turn, its end-of-turn token and its voices (``OmniSpeech``).

The other fields: ``instructions`` join the user turn (the talker hears the prompt through
the thinker); ``language`` is ``auto`` only (the model speaks the text's own);
``task_type`` is ``CustomVoice`` (a named voice) if given; ``non_streaming_mode`` is false
if given (the talker takes the text a token per step, as the thinker says it); a cloned
voice (``ref_audio``, ``ref_text``, ``x_vector_only_mode``, ``speaker_embedding``) is not
one an omni model speaks.
Anything else is a 400 naming the field.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from omnistage.errors import InvalidRequestError
from omnistage.models.interfaces import SpeechInput

# The system turn Qwen gives its omni models for speech output (Qwen2.5-Omni's model card:
# transformers warns that audio may not work without it; Qwen3-Omni's examples keep it).
QWEN_SYSTEM_PROMPT = (
    "You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
    "perceiving auditory and visual inputs, as well as generating text and speech."
)
USER_TURN = "Read the text aloud."
MAX_INSTRUCTIONS = 500  # characters, as the Qwen3-TTS route bounds them
VOICE_FIELD = "audio_params"  # where a request names its voice, as on chat
TALKER_FIELD = "talker_params"  # the request field of the stage that speaks


@dataclass(frozen=True)
class OmniSpeech:
    """A family's part: its system turn (None: its template's own), the token that ends the
    thinker's turn, and its voices (``voices(folder)``: the checkpoint's names, which a
    request may give in any case)."""

    system_prompt: str | None
    end_of_turn: str
    voices: Callable[[str], list[str]]

    def messages(self, instructions: str | None = None) -> list[dict[str, str]]:
        """The chat the thinker answers: the same on the chat route speaks the same."""
        user = USER_TURN if not instructions else f"{USER_TURN} {instructions}"
        system = (
            []
            if self.system_prompt is None
            else [{"role": "system", "content": self.system_prompt}]
        )
        return [*system, {"role": "user", "content": user}]

    def voice(self, folder: str, asked: str | None) -> str | None:
        """The checkpoint's name of the asked voice (None: the model's default)."""
        if not asked:
            return None
        names = self.voices(folder)
        found = next((name for name in names if name.casefold() == asked.casefold()), None)
        if found is None:
            raise InvalidRequestError("voice", f"unknown voice {asked!r}; this model has {names}")
        return found

    def prompt(
        self, folder: str, encode: Callable[[str], list[int]], speech: SpeechInput
    ) -> dict[str, Any]:
        check_fields(speech)
        specials = special_tokens(folder)
        text, instructions = speech.text, speech.instructions or None
        if not text.strip():
            raise InvalidRequestError("input", "must not be empty")
        if instructions is not None and len(instructions) > MAX_INSTRUCTIONS:
            raise InvalidRequestError(
                "instructions", f"is longer than {MAX_INSTRUCTIONS} characters"
            )
        for name, value in (("input", text), ("instructions", instructions or "")):
            token = next((t for t in specials if t in value), None)
            if token is not None:
                raise InvalidRequestError(name, f"must not hold the model's special token {token}")
        end = encode(self.end_of_turn)
        if len(end) != 1:
            raise InvalidRequestError("model", f"{self.end_of_turn} is not one token here")
        prompt: dict[str, Any] = {
            "messages": self.messages(instructions),
            "forced_token_ids": encode(text) + end,
            "sampling_params_for": TALKER_FIELD,
        }
        voice = self.voice(folder, speech.voice)
        if voice is not None:
            prompt["request_params"] = {VOICE_FIELD: {"voice": voice}}
        return prompt


def check_fields(speech: SpeechInput) -> None:
    """The speech fields an omni model does not take refused, each naming itself."""
    if speech.language is not None and speech.language.casefold() != "auto":
        raise InvalidRequestError(
            "language", "an omni model speaks the text in its own language: only auto"
        )
    if speech.task_type not in (None, "CustomVoice"):
        raise InvalidRequestError(
            "task_type", "an omni model speaks a named voice: CustomVoice (or leave it out)"
        )
    for name in ("ref_audio", "ref_text", "x_vector_only_mode", "speaker_embedding"):
        if getattr(speech, name, None) is not None:
            raise InvalidRequestError(
                name, "an omni model speaks its own voices: it clones none (use voice)"
            )
    if speech.non_streaming_mode:
        raise InvalidRequestError(
            "non_streaming_mode",
            "an omni model's talker takes the text a token per step, as its thinker says it "
            "(false, or leave it out)",
        )


@functools.lru_cache(maxsize=8)
def special_tokens(folder: str) -> tuple[str, ...]:
    """The tokenizer's special tokens (a text holding one would say a control token)."""
    from omnistage.models.tokenizer import Tokenizer

    added = Tokenizer.from_pretrained(folder).backend.get_added_tokens_decoder()
    return tuple(sorted(t.content for t in added.values() if t.special))
