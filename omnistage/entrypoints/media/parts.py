"""Chat content parts that carry media (``input_audio``, ``image_url``, ``audio_url``,
``video_url``): counted against ``--limit-mm-per-prompt`` before any is loaded, then each
fetched (async: a slow URL holds up no other request) and decoded in a worker thread into a
``MediaItem`` whose ``content_hash`` names its bytes and the options that change its value.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from omnistage.entrypoints.media.decode import decode_audio, decode_image
from omnistage.entrypoints.media.policy import MediaPolicy, too_many_bytes
from omnistage.entrypoints.media.pool import run_decode
from omnistage.entrypoints.media.sources import (
    base64_bytes,
    base64_size,
    data_url_payload,
    fetch,
    read_file,
)
from omnistage.entrypoints.media.video import decode_video
from omnistage.errors import InvalidRequestError
from omnistage.models.media import (
    DEFAULT_VIDEO_FPS,
    MODALITIES,
    Audio,
    MediaItem,
    Modality,
    Video,
    content_hash,
)

if TYPE_CHECKING:
    from PIL.Image import Image

# The content part types that carry media, and the modality of each.
PART_MODALITIES: dict[str, Modality] = {
    "input_audio": "audio",
    "audio_url": "audio",
    "image_url": "image",
    "video_url": "video",
}
# ``input_audio.format`` values (OpenAI's wav and mp3, and what soundfile also reads).
AUDIO_FORMATS = ("wav", "flac", "mp3", "ogg")

_NO_OPTIONS: Mapping[str, Any] = MappingProxyType({})


def part_modality(part: Any) -> Modality | None:
    """The modality a chat content part carries (None for text or a type without media): to
    count a prompt's parts against ``limit_mm_per_prompt`` before loading any."""
    kind = part.get("type") if isinstance(part, Mapping) else None
    return PART_MODALITIES.get(kind) if isinstance(kind, str) else None


async def load_part(
    part: Mapping[str, Any],
    field: str,
    policy: MediaPolicy,
    options: Mapping[str, Any] = _NO_OPTIONS,
    *,
    options_field: str = "mm_processor_kwargs",
) -> MediaItem:
    """Fetch and decode one media content part (``field`` names it, as
    ``messages[0].content[1]``).

    ``options``: for a video, ``fps`` (frames sampled per second, default 2.0) or
    ``num_frames`` (that many, spread over its duration), and ``use_audio_in_video`` (also
    decode its audio track); errors in them name
    ``options_field``. They travel in the item's ``options``; those that change the decoded
    value are part of its ``content_hash`` with the raw bytes and the modality.
    """
    if not isinstance(part, Mapping):
        raise InvalidRequestError(field, "must be an object")
    kind = part.get("type")
    modality = part_modality(part)
    if modality is None:
        raise InvalidRequestError(
            f"{field}.type",
            f"{kind!r} is not a media part; expected one of {sorted(PART_MODALITIES)}",
        )
    assert isinstance(kind, str)
    opts = _decode_options(modality, options, options_field)
    payload = part.get(kind)
    if kind == "input_audio":
        where = f"{field}.input_audio"
        if not isinstance(payload, Mapping):
            raise InvalidRequestError(where, 'must be an object {"data": ..., "format": ...}')
        fmt = payload.get("format")
        if fmt not in AUDIO_FORMATS:
            raise InvalidRequestError(
                f"{where}.format",
                f"unsupported audio format {fmt!r}; supported: {', '.join(AUDIO_FORMATS)}",
            )
        data = payload.get("data")
        if not isinstance(data, str):
            raise InvalidRequestError(f"{where}.data", "must be a base64 string")
        return await _base64_item(data, f"{where}.data", modality, policy, opts)
    if isinstance(payload, str):  # vLLM's plain form: {"image_url": "https://..."}
        url, where = payload, f"{field}.{kind}"
    elif isinstance(payload, Mapping) and isinstance(payload.get("url"), str):
        url, where = payload["url"], f"{field}.{kind}.url"
    else:
        raise InvalidRequestError(f"{field}.{kind}", 'must be {"url": "..."} or a URL string')
    return await _url_item(url, where, modality, policy, opts)


def check_counts(
    items: Iterable[MediaItem | str], policy: MediaPolicy, field: str = "messages"
) -> None:
    """Refuse (400) a prompt with more items of a modality than ``limit_mm_per_prompt`` allows.

    ``items``: loaded items, or the modality names of parts not loaded yet (``part_modality``),
    so that a prompt over the limit is refused before any of its media is fetched.
    """
    counts = Counter(i if isinstance(i, str) else i.modality for i in items)
    for modality in MODALITIES:
        count, limit = counts[modality], policy.limit_mm_per_prompt.get(modality, 4)
        if count > limit:
            raise InvalidRequestError(
                field,
                f"this server takes no {modality} input (--limit-mm-per-prompt)"
                if limit == 0
                else f"{count} {modality} items in one prompt, more than the {limit} allowed "
                "(--limit-mm-per-prompt)",
            )


def _decode_options(
    modality: Modality, options: Mapping[str, Any], options_field: str
) -> dict[str, Any]:
    """The options as the item carries them, a video's decoding options checked and filled."""
    if not isinstance(options, Mapping):
        raise InvalidRequestError(options_field, "must be an object")
    opts = dict(options)
    if modality == "video":
        fps = opts.get("fps", DEFAULT_VIDEO_FPS)
        if (
            isinstance(fps, bool)
            or not isinstance(fps, (int, float))
            or not math.isfinite(fps)
            or fps <= 0
        ):
            raise InvalidRequestError(
                f"{options_field}.fps", f"must be a positive number, got {fps!r}"
            )
        with_audio = opts.get("use_audio_in_video", False)
        if not isinstance(with_audio, bool):
            raise InvalidRequestError(
                f"{options_field}.use_audio_in_video", f"must be true or false, got {with_audio!r}"
            )
        opts["fps"], opts["use_audio_in_video"] = float(fps), with_audio
        num_frames = opts.get("num_frames")
        if num_frames is not None and (
            isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1
        ):
            raise InvalidRequestError(
                f"{options_field}.num_frames", f"must be a positive integer, got {num_frames!r}"
            )
    else:
        opts.pop("num_frames", None)  # a video's sampling only
    return opts


async def _base64_item(
    data: str, where: str, modality: Modality, policy: MediaPolicy, opts: dict[str, Any]
) -> MediaItem:
    """A base64 payload: its size checked from its length, decoded (both) off the loop."""
    size = base64_size(data)
    if size > policy.max_media_bytes:
        raise too_many_bytes(where, size, policy)

    def run() -> MediaItem:
        return _decode_item(base64_bytes(data, where), where, modality, policy, opts)

    return await run_decode(policy.decode_workers, run)


async def _url_item(
    url: str, where: str, modality: Modality, policy: MediaPolicy, opts: dict[str, Any]
) -> MediaItem:
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":
        return await _base64_item(
            data_url_payload(url, where, modality), where, modality, policy, opts
        )
    if scheme == "file":
        return await run_decode(
            policy.decode_workers,
            lambda: _decode_item(read_file(url, where, policy), where, modality, policy, opts),
        )
    if scheme in ("http", "https"):
        raw = await fetch(url, where, policy)
        return await run_decode(
            policy.decode_workers, _decode_item, raw, where, modality, policy, opts
        )
    raise InvalidRequestError(
        where, f"unsupported URL scheme {scheme!r}; use data:, file:// or http(s)://"
    )


def _decode_item(
    raw: bytes, where: str, modality: Modality, policy: MediaPolicy, opts: dict[str, Any]
) -> MediaItem:
    """Raw bytes to an item (in a worker thread: decoding and hashing are CPU work)."""
    value: Audio | Image | Video
    if modality == "audio":
        value = decode_audio(raw, where, policy)
        digest = content_hash("audio", raw)
    elif modality == "image":
        value = decode_image(raw, where, policy)
        digest = content_hash("image", raw)
    else:
        fps, with_audio = opts["fps"], opts["use_audio_in_video"]
        num_frames = opts.pop("num_frames", None)  # how to sample, not the processor's
        value = decode_video(raw, where, policy, fps, with_audio, num_frames)
        digest = content_hash(
            "video", raw, f"fps={fps!r}", f"use_audio_in_video={with_audio}", f"n={num_frames}"
        )
    return MediaItem(modality=modality, value=value, content_hash=digest, options=opts)
