"""Speech encoded in each format a reply may ask for decodes back to the same speech."""

from __future__ import annotations

import numpy as np
import pytest

from omnistage.engine.outputs import OmniAudio
from omnistage.entrypoints.media.decode import decode_audio
from omnistage.entrypoints.media.policy import MediaPolicy
from omnistage.entrypoints.openai.audio_formats import encode_audio

RATE = 24000


def _speech() -> OmniAudio:
    t = np.arange(RATE) / RATE
    return OmniAudio((0.4 * np.sin(2 * np.pi * 300 * t)).astype(np.float32), RATE)


@pytest.mark.parametrize("fmt", ["wav", "flac", "mp3", "opus", "aac"])
def test_each_format_decodes_back_to_the_speech(fmt: str) -> None:
    speech = _speech()
    data = encode_audio(speech, fmt)
    decoded = decode_audio(data, "audio", MediaPolicy())
    rate = decoded.sampling_rate
    assert rate == RATE  # 24 kHz is an Opus rate too
    # lossy codecs add priming samples; the length is a second within a frame or two
    assert abs(decoded.seconds - 1.0) < 0.1
    lossless = fmt in ("wav", "flac")
    if lossless:
        assert np.array_equal(
            np.round(decoded.samples * 32768).astype(np.int16)[:RATE],
            np.frombuffer(speech.pcm16(), "<i2"),
        )
    else:
        spectrum = np.abs(np.fft.rfft(decoded.samples[: rate // 2]))
        assert abs(float(np.fft.rfftfreq(rate // 2, 1 / rate)[np.argmax(spectrum)]) - 300) < 5


def test_aac_is_an_adts_stream() -> None:
    data = encode_audio(_speech(), "aac")
    assert data[0] == 0xFF and data[1] & 0xF0 == 0xF0  # the ADTS sync word
