"""What a client gets from a stage kind that produces media: an image, a video, a waveform.

Each kind's wire output (``ImageOutput``, ``VideoOutput``, ``AudioOutput``) turns into one of
these with ``to_client()`` in the API process; ``AsyncOmni.generate`` yields them.
"""

from __future__ import annotations

import io
import wave
from dataclasses import dataclass, field

import numpy as np


@dataclass
class OmniImage:
    png: bytes
    width: int
    height: int
    seed: int | None = None


@dataclass
class OmniVideo:
    """An MP4 (H.264) of ``num_frames`` frames of ``width`` x ``height`` at ``fps``."""

    mp4: bytes
    width: int
    height: int
    num_frames: int
    fps: int
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
