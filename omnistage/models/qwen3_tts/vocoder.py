"""Qwen3-TTS's speech-tokenizer decoder as the code2wav stage runs it (``Qwen3TTSVocoder``):
an utterance's codes, flat and frame-major, decoded window by window as the reference's
``decode`` does them; its voices are the checkpoint's speakers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omnistage.errors import InvalidRequestError
from omnistage.memory import Arena
from omnistage.models.qwen3_tts.code2wav import Qwen3TTSDecoder

DEFAULT_VOICE = "default"  # the voice of a checkpoint without named speakers


class Qwen3TTSVocoder(Qwen3TTSDecoder):
    """The decoder of a Qwen3-TTS checkpoint as the code2wav stage runs it: an utterance's
    codes (flat, frame-major) decoded as the reference's ``decode`` does them, one window of
    ``chunked_decode`` per step (Qwen3-Omni's ``Code2WavSynthesis``: the same windows). Its
    voices are the checkpoint's speakers (the talker speaks in them; the decoder has none).
    Streamed decoding is not here yet: a streamed request is refused, naming ``stream``."""

    def __init__(self, folder: str | Path, arena: Arena, *, load: bool = True) -> None:
        super().__init__(folder, arena, load=load)
        from omnistage.models.qwen3_tts.config import is_tts_checkpoint, read_config

        speakers = sorted(read_config(folder).speakers) if is_tts_checkpoint(folder) else []
        self.voices = speakers or [DEFAULT_VOICE]
        self.default_voice = self.voices[0]

    @property
    def max_codes(self) -> int:
        """The most codes one utterance may have (``max_position_embeddings`` frames)."""
        return int(self.config.max_position_embeddings) * self.codes_per_frame

    def codes_tensor(self, codes: list[int]) -> torch.Tensor:
        from omnistage.models.qwen3_omni.code2wav import codes_tensor

        return codes_tensor(codes, self.codes_per_frame, self.device)

    def synthesis(self, codes: list[int], params: Any, seed: int) -> Any:
        """One utterance's decode, a window per step (``seed`` unused: no noise is drawn)."""
        from omnistage.models.qwen3_omni.code2wav import Code2WavSynthesis

        return Code2WavSynthesis(self, codes, params)

    def streaming_synthesis(self, params: Any, seed: int, chunks: Any) -> Any:
        raise InvalidRequestError(
            "stream", "a Qwen3-TTS decoder takes an utterance's codes whole (not streamed yet)"
        )

    def advance_together(self, items: list[Any]) -> None:
        """One step of each synthesis, one after another (never batched)."""
        for item in items:
            item.advance()
