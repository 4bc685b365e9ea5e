"""A speech answer's ``speed``: its length divided by the speed, its pitch kept."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage.entrypoints.openai.audio_speed import time_stretch

RATE = 24000


def _tone(hz: float, seconds: float = 1.0) -> np.ndarray:
    t = np.arange(int(RATE * seconds)) / RATE
    return (0.5 * np.sin(2 * np.pi * hz * t)).astype(np.float32)


def _pitch(samples: np.ndarray) -> float:
    middle = samples[len(samples) // 4 : 3 * len(samples) // 4]
    spectrum = np.abs(np.fft.rfft(middle * np.hanning(len(middle))))
    return float(np.fft.rfftfreq(len(middle), 1 / RATE)[np.argmax(spectrum)])


@pytest.mark.parametrize("speed", [0.25, 0.5, 1.5, 2.0, 4.0])
def test_a_stretched_tone_lasts_len_over_speed_at_its_pitch(speed: float) -> None:
    tone = _tone(440.0)
    out = time_stretch(tone, speed)
    assert out.dtype == np.float32
    assert len(out) == int(len(tone) / speed)
    assert abs(_pitch(out) - 440.0) <= 2.0  # a 2 Hz bin at these lengths
    assert np.isfinite(out).all() and np.abs(out).max() <= 1.0


def test_speed_one_and_empty_audio_come_back_unchanged() -> None:
    tone = _tone(220.0, 0.1)
    assert time_stretch(tone, 1.0) is tone
    empty = np.zeros(0, np.float32)
    assert time_stretch(empty, 2.0) is empty


def test_a_clip_shorter_than_the_window_is_stretched_too() -> None:
    out = time_stretch(_tone(440.0, 0.004), 2.0)  # 96 samples: under half the window
    assert len(out) == 48 and np.isfinite(out).all()
