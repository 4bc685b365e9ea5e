"""Speech as the bytes of a reply's ``audio.format``, as vLLM-Omni serves them: ``wav`` (16-bit
PCM, the default), ``pcm`` / ``pcm16`` (raw 16-bit little-endian samples, no header), ``flac``,
``mp3`` and ``opus`` (in Ogg), each encoded by libsndfile (soundfile), and ``aac`` (in ADTS,
as OpenAI's speech route answers it; FFmpeg's encoder through PyAV). Mono, at the model's
rate; Opus only has 8, 12, 16, 24 and 48 kHz, so another rate is resampled to 48 kHz for it.
"""

from __future__ import annotations

import io

import numpy as np

from omnistage.engine.outputs import OmniAudio

RAW_FORMATS = ("pcm", "pcm16")
# What soundfile writes for each compressed format: its format and subtype.
_SOUNDFILE = {
    "flac": ("FLAC", "PCM_16"),
    "mp3": ("MP3", "MPEG_LAYER_III"),
    "opus": ("OGG", "OPUS"),
}
OPUS_RATES = (8000, 12000, 16000, 24000, 48000)
# Formats whose pieces join into the whole (raw samples; a WAV after its one header): an
# OpenAI-shaped stream sends them piece by piece, the others once complete.
JOINABLE = ("wav", *RAW_FORMATS)


def encode_audio(audio: OmniAudio, audio_format: str) -> bytes:
    """One complete file (or raw samples) of ``audio`` in ``audio_format``."""
    if audio_format == "wav":
        return audio.wav_bytes()
    if audio_format in RAW_FORMATS:
        return audio.pcm16()
    if audio_format == "aac":
        return _aac(audio)
    import soundfile

    fmt, subtype = _SOUNDFILE[audio_format]
    rate = audio.sample_rate
    if audio_format == "opus" and rate not in OPUS_RATES:
        import soxr

        audio = OmniAudio(soxr.resample(audio.samples, rate, 48000), 48000)
        rate = 48000
    # The 16-bit samples the other formats carry: a FLAC decodes to exactly the pcm16's.
    samples = np.frombuffer(audio.pcm16(), dtype="<i2")
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate, format=fmt, subtype=subtype)
    return buffer.getvalue()


def _aac(audio: OmniAudio) -> bytes:
    """``audio`` as AAC-LC in an ADTS stream (FFmpeg's native encoder, its default bit rate)."""
    import av

    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="adts") as container:
        stream = container.add_stream("aac", rate=audio.sample_rate)
        stream.layout = "mono"
        samples = np.ascontiguousarray(audio.samples, dtype=np.float32)[None, :]
        frame = av.AudioFrame.from_ndarray(samples, format="fltp", layout="mono")
        frame.sample_rate = audio.sample_rate
        for packet in (*stream.encode(frame), *stream.encode(None)):
            container.mux(packet)
    return buffer.getvalue()
