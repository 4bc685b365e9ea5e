"""A cloned voice's reference clip, as the speech route resolves it: ``ref_audio`` (an
http(s) or ``file://`` URL, a ``data:audio/...`` URI or plain base64, fetched and decoded under
the chat route's media policy) or an uploaded voice's bytes, at most ``MAX_REF_SECONDS``,
resampled to ``REF_RATE`` with soxr. The one place a clip is read (``voices.py`` checks an
upload with ``reference_clip`` too)."""

from __future__ import annotations

import numpy as np

from omnistage.entrypoints.media.decode import decode_audio, resample
from omnistage.entrypoints.media.policy import MediaPolicy, too_many_bytes
from omnistage.entrypoints.media.pool import run_decode
from omnistage.entrypoints.media.sources import (
    base64_bytes,
    base64_size,
    data_url_payload,
    fetch,
    read_file,
)
from omnistage.errors import InvalidRequestError

MAX_REF_SECONDS = 30.0  # a reference clip, as vLLM-Omni bounds it
REF_RATE = 24000  # the rate a clip is handed to a family at (it resamples for another)


async def reference(
    source: str | None, policy: MediaPolicy, clip: bytes | None = None
) -> tuple[np.ndarray, int] | None:
    """The clip a cloned voice speaks in: mono float32 samples at 24 kHz and the rate, or None
    without one. ``ref_audio`` is an http(s) or ``file://`` URL, a ``data:audio/...`` URI or
    plain base64, fetched and decoded under ``policy`` (a 400 naming ``ref_audio``: bad, too
    big, undecodable, longer than ``MAX_REF_SECONDS``); ``clip``: an uploaded voice's bytes."""
    if clip is not None:
        return await reference_clip(clip, "ref_audio", policy)
    if source is None:
        return None
    where = "ref_audio"
    scheme = source.split(":", 1)[0].lower() if ":" in source[:16] else ""
    if scheme in ("http", "https"):
        raw = await fetch(source, where, policy)
    elif scheme == "file":
        raw = await run_decode(policy.decode_workers, read_file, source, where, policy)
    else:
        data = data_url_payload(source, where, "audio") if scheme == "data" else source
        if base64_size(data) > policy.max_media_bytes:
            raise too_many_bytes(where, base64_size(data), policy)
        raw = await run_decode(policy.decode_workers, base64_bytes, data, where)
    return await reference_clip(raw, where, policy)


async def reference_clip(raw: bytes, where: str, policy: MediaPolicy) -> tuple[np.ndarray, int]:
    """A reference clip's bytes decoded under ``policy``, at most ``MAX_REF_SECONDS``, as mono
    float32 samples at 24 kHz (a 400 naming ``where`` otherwise)."""

    def decode() -> tuple[np.ndarray, int]:
        audio = decode_audio(raw, where, policy)
        seconds = len(audio.samples) / audio.sampling_rate
        if seconds > MAX_REF_SECONDS:
            raise InvalidRequestError(
                where, f"is {seconds:.1f} s, longer than the {MAX_REF_SECONDS:g} s a reference "
                "clip may be"
            )  # fmt: skip
        audio = resample(audio, REF_RATE)
        return np.ascontiguousarray(audio.samples, dtype=np.float32), audio.sampling_rate

    return await run_decode(policy.decode_workers, decode)
