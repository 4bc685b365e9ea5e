"""What ``AsyncOmni.generate`` yields."""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnistage.stage.messages import TokenLogprobs


@dataclass
class OmniImage:
    png: bytes
    width: int
    height: int
    seed: int | None = None


@dataclass
class OmniAudio:
    """A waveform: float32 samples in [-1, 1] (1-D numpy) at ``sample_rate`` Hz."""

    samples: np.ndarray
    sample_rate: int
    voice: str = ""
    seed: int | None = None
    codes: list[int] = field(default_factory=list)  # the speech codes it speaks

    @property
    def duration_s(self) -> float:
        return len(self.samples) / self.sample_rate

    def pcm16(self) -> bytes:
        """Little-endian signed 16-bit samples (OpenAI's ``pcm16``)."""
        clipped = np.clip(self.samples, -1.0, 1.0)
        return (clipped * 32767.0).round().astype("<i2").tobytes()

    def wav_bytes(self) -> bytes:
        """A mono 16-bit PCM WAV file."""
        buffer = io.BytesIO()
        with wave.open(buffer, "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(self.sample_rate)
            out.writeframes(self.pcm16())
        return buffer.getvalue()


@dataclass
class OmniRequestOutput:
    """One update of a request: a text delta from an AR stage, or a finished stage's result.

    ``final`` is True on the last output of the whole request (all stages and all samples
    done, or ended early by abort/error); ``finished`` when this stage is done with this
    sample (``index``).
    """

    request_id: str
    stage_id: int
    modality: str  # "text", "image" or "audio"
    index: int = 0  # which of the request's ``n`` samples
    text_delta: str = ""
    new_token_ids: list[int] = field(default_factory=list)
    finished: bool = False  # this stage is done with the request
    final: bool = False
    finish_reason: str | None = None
    images: list[OmniImage] = field(default_factory=list)
    audio: list[OmniAudio] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one entry per token of the delta
    prompt_logprobs: list[TokenLogprobs | None] | None = None  # once, on a sample's first
    extra: dict[str, Any] = field(default_factory=dict)
