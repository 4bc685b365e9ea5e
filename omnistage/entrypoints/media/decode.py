"""Audio and image bytes decoded (off the event loop, by the caller) into the plain values of
``omnistage.models.media``, and the container helpers video decoding shares.

Untrusted bytes reach only allow-listed decoders (Pillow's common formats, FFmpeg's plain
demuxers). A duration or a picture size is checked from the header before anything is decoded
(and a duration again while decoding: a header may lie); any error a decoding library raises on
bad input is a 400 naming the field, never a 500.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from omnistage.entrypoints.media.policy import MediaPolicy, too_long
from omnistage.errors import InvalidRequestError
from omnistage.models.media import Audio, mono_audio, rgb_image

if TYPE_CHECKING:
    from PIL.Image import Image

# Image formats Pillow may open: the ones people send. Others (EPS runs Ghostscript, and
# rarer plug-ins are rarely audited) are refused.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
# FFmpeg demuxers PyAV may open. An allow-list, because FFmpeg's playlist demuxers (hls,
# concat, ...) would open the files and URLs a playlist names, past every check here.
AV_FORMATS = "mov,mp4,matroska,webm,avi,mpeg,mpegts,flv,ogg,wav,flac,mp3,aac,w64,aiff"

_T = TypeVar("_T")


def decoding(where: str, what: str, run: Callable[[], _T]) -> _T:
    """``run()``, with any error of a decoding library on untrusted bytes as a 400."""
    try:
        return run()
    except InvalidRequestError:
        raise
    except Exception as exc:  # the libraries raise many types on bad input
        raise InvalidRequestError(
            where, f"cannot decode the {what}: {type(exc).__name__}: {exc}"
        ) from None


def open_av(raw: bytes) -> Any:
    """A PyAV input container over ``raw``, only through the demuxers of ``AV_FORMATS``."""
    import av

    return av.open(io.BytesIO(raw), mode="r", options={"format_whitelist": AV_FORMATS})


def duration(stream: Any, container: Any) -> float | None:
    """A stream's duration in seconds from the container's header (None when it says none)."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base)
    if container.duration:
        return container.duration / 1_000_000  # AV_TIME_BASE
    return None


def decode_audio(raw: bytes, where: str, policy: MediaPolicy) -> Audio:
    """Audio bytes (wav, flac, mp3, ogg through soundfile; other containers through PyAV) as
    mono float32 at the source's rate. The duration is checked from the header, and again
    while decoding (a header may lie)."""
    import soundfile as sf

    try:
        f = sf.SoundFile(io.BytesIO(raw))
    except Exception:  # not a format libsndfile reads: try FFmpeg's demuxers
        return decoding(where, "audio", lambda: _decode_audio_av(raw, where, policy))

    def run() -> Audio:
        with f:
            rate = f.samplerate
            if rate <= 0:
                raise InvalidRequestError(where, "the audio has no sampling rate")
            header = f.frames if 0 < f.frames < 2**62 else None
            samples = _Samples(where, "audio", rate, policy, header)
            size = 1 << 16
            while True:  # to the end of the stream, whatever length the header gave
                block = f.read(size, dtype="float32", always_2d=True)
                if not len(block):
                    break
                samples.add(block.mean(axis=1) if block.shape[1] > 1 else block[:, 0])
                if len(block) < size:
                    break
            return mono_audio(samples.whole(), rate, in_place=True)

    return decoding(where, "audio", run)


class _Samples:
    """A decoded audio's mono samples, bounded in seconds and in bytes (``--max-audio-seconds``,
    ``--max-audio-decoded-bytes``) before decoding where the header says the length, and while
    decoding; filled in place when the header says it (one copy, not two, at the peak)."""

    def __init__(
        self, where: str, what: str, rate: int, policy: MediaPolicy, header: int | None
    ) -> None:
        self.where, self.what, self.rate, self.policy = where, what, rate, policy
        self.limit = min(int(policy.max_audio_seconds * rate), policy.max_audio_decoded_bytes // 4)
        if header is not None:
            self._check(header)
        self.buffer = np.empty(0, np.float32)
        if header:  # counted against the server's budget before it is allocated
            budget = policy.budget
            if budget is not None:
                budget.take(header * 4, where)
            try:
                self.buffer = np.empty(header, np.float32)
            except BaseException:
                if budget is not None:
                    budget.give_back(header * 4)
                raise
            if budget is not None:
                budget.attach(self.buffer, header * 4)
        self.spilled: list[np.ndarray] = []
        self.total = 0

    def _check(self, count: int) -> None:
        if count > int(self.policy.max_audio_seconds * self.rate):
            raise too_long(
                self.where, self.what, count / self.rate, self.policy.max_audio_seconds,
                "--max-audio-seconds",
            )  # fmt: skip
        if count * 4 > self.policy.max_audio_decoded_bytes:
            raise InvalidRequestError(
                self.where,
                f"the {self.what} decodes to {count * 4} bytes ({count} samples at {self.rate} "
                f"Hz), more than the {self.policy.max_audio_decoded_bytes} allowed "
                "(--max-audio-decoded-bytes)",
            )

    def add(self, mono: np.ndarray) -> None:
        self._check(self.total + len(mono))
        end = self.total + len(mono)
        if not self.spilled and end <= len(self.buffer):
            self.buffer[self.total : end] = mono
        else:  # longer than its header said
            if not self.spilled:
                self.spilled.append(self.buffer[: self.total])
            self.spilled.append(np.array(mono, dtype=np.float32))
        self.total = end

    def whole(self) -> np.ndarray:
        if not self.total:
            raise InvalidRequestError(self.where, f"the {self.what} has no samples")
        return np.concatenate(self.spilled) if self.spilled else self.buffer[: self.total]


def _decode_audio_av(raw: bytes, where: str, policy: MediaPolicy) -> Audio:
    """The first audio track of a container, through PyAV: mono float32 at its own rate."""
    audio = audio_track(raw, where, policy, "audio")
    if audio is None:
        raise InvalidRequestError(where, "the audio has no audio track")
    return audio


def audio_track(raw: bytes, where: str, policy: MediaPolicy, what: str) -> Audio | None:
    """The first audio track of a container as mono float32 at its own rate (None without
    one); its duration checked from the header, then while decoding."""
    import av

    with open_av(raw) as container:
        if not container.streams.audio:
            return None
        stream = container.streams.audio[0]
        rate = stream.rate or stream.codec_context.sample_rate
        if not rate:
            raise InvalidRequestError(where, f"the {what} has no sampling rate")
        seconds = duration(stream, container)
        header = int(seconds * rate) if seconds is not None else None
        samples = _Samples(where, what, rate, policy, header)
        resampler = av.AudioResampler(format="flt", layout="mono", rate=rate)

        def add(frames: Iterable[Any]) -> None:
            for out in frames:
                samples.add(out.to_ndarray().reshape(-1))

        for frame in container.decode(stream):
            add(resampler.resample(frame))
        add(resampler.resample(None))
        return mono_audio(samples.whole(), rate, in_place=True)


def decode_image(raw: bytes, where: str, policy: MediaPolicy) -> Image:
    """Image bytes as an RGB Pillow image (transparency over white, as vLLM does). Its size is
    checked from the header before the pixels are decoded."""
    from PIL import Image as PILImage

    def run() -> Image:
        try:
            image = PILImage.open(io.BytesIO(raw), formats=IMAGE_FORMATS)
        except PILImage.DecompressionBombError as exc:
            raise InvalidRequestError(where, f"the image is too large: {exc}") from None
        width, height = image.size
        if width * height > policy.max_image_pixels:
            raise InvalidRequestError(
                where,
                f"the image of {width}x{height} pixels is larger than the "
                f"{policy.max_image_pixels} pixels allowed (--max-input-image-pixels)",
            )
        image.load()
        return rgb_image(image)

    return decoding(where, "image", run)


def resample(audio: Audio, rate: int) -> Audio:
    """``audio`` at ``rate`` Hz (soxr, high quality), for an encoder with a fixed rate."""
    if rate <= 0:
        raise ValueError(f"rate must be positive, got {rate}")
    if rate == audio.sampling_rate:
        return audio
    import soxr

    samples = soxr.resample(audio.samples, audio.sampling_rate, rate, quality="HQ")
    return Audio(np.clip(samples.astype(np.float32, copy=False), -1.0, 1.0), rate)
