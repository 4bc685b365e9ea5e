"""The server's media settings (vLLM's media flags and omnistage's limits), a part of
``ServerConfig``: which media URLs a request may name and how large a medium may be."""

from __future__ import annotations

import json
import re
import typing
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, StrictInt, field_validator

from omnistage.config import ByteCount

# The media modalities a prompt may bring (``omnistage.models.media.MODALITIES``, spelled out
# here so that the command line does not import numpy), and how many of each by default.
MediaModalityName = Literal["audio", "image", "video"]
DEFAULT_MM_PER_PROMPT = 4


def _mm_limits(given: dict[MediaModalityName, int]) -> dict[MediaModalityName, int]:
    """Every modality's limit: the one given, else the default."""
    return {m: given.get(m, DEFAULT_MM_PER_PROMPT) for m in typing.get_args(MediaModalityName)}


def _json_object(value: Any) -> Any:
    """``--limit-mm-per-prompt '{"image": 2}'``: the flag's JSON text as a mapping."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise ValueError(
            f'must be a JSON object such as \'{{"image": 2, "audio": 1}}\', got {value!r}'
        ) from None


def _host_list(value: Any) -> Any:
    """Host names given as one string or several, each comma- or space-separated."""
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)):
        return value
    hosts: list[Any] = []
    for item in items:
        if isinstance(item, str):
            hosts.extend(p for p in re.split(r"[,\s]+", item) if p)
        else:
            hosts.append(item)
    return hosts


class MediaSettings(BaseModel):
    allowed_local_media_path: str | None = Field(
        default=None,
        description="Folder whose files a request may name as file:// media URLs (symlinks "
        "and '..' resolved; nothing outside it) (default: none, file:// URLs are refused).",
    )
    allowed_media_domains: Annotated[list[str], BeforeValidator(_host_list)] = Field(
        default_factory=list,
        description="Host names whose http(s) media URLs a request may name (exact match; "
        "redirects only to these), e.g. --allowed-media-domains upload.example.org "
        "cdn.example.org (default: none, http(s) URLs are refused).",
    )
    limit_mm_per_prompt: Annotated[
        dict[MediaModalityName, Annotated[StrictInt, Field(ge=0)]],
        BeforeValidator(_json_object),
    ] = Field(
        default_factory=lambda: _mm_limits({}),
        description='Most media items of each modality in one prompt, as JSON: \'{"image": 2, '
        '"audio": 1, "video": 1}\' (default: 4 of each; a modality not named keeps 4, 0 '
        "refuses it).",
    )
    media_fetch_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="Longest fetch of one http(s) media URL, redirects included; a slower one "
        "is refused (400).",
    )
    max_media_bytes: ByteCount = Field(
        default=32 * 1024 * 1024,
        gt=0,
        description="Largest media item a request may bring, in bytes: a data URL's decoded "
        "bytes, a file, a download (units such as '64MiB' accepted; default: 32MiB).",
    )
    max_audio_seconds: float = Field(
        default=600.0, gt=0, description="Longest audio item (or video audio track), in seconds."
    )
    max_input_image_pixels: int = Field(
        default=4096 * 4096,
        gt=0,
        description="Largest input image or video frame (width x height), checked from its "
        "header before its pixels are decoded (default: 4096x4096).",
    )
    max_video_frames: int = Field(
        default=256,
        gt=0,
        description="Most frames sampled from one video (its duration x the requested fps); "
        "more is refused (400) instead of lowering the fps unasked.",
    )
    max_video_seconds: float = Field(
        default=600.0, gt=0, description="Longest video item, in seconds."
    )
    max_audio_decoded_bytes: ByteCount = Field(
        default=600 * 48000 * 4,
        gt=0,
        description="Most memory one audio item may take decoded (its samples x 4 bytes, "
        "mono float32), checked from its header before it is decoded and again while it is: "
        "a small file of a high rate cannot swell the server (units such as '256MiB' "
        "accepted; default: 600 s at 48 kHz, about 110 MiB).",
    )
    max_media_decoded_bytes_in_flight: ByteCount = Field(
        default=1024 * 1024 * 1024,
        gt=0,
        description="Most memory the decoded media of all requests may take at once in the "
        "API process, from their decoding until their prompts are prepared; a request that "
        "would pass it waits for room (30 s, then a 429), one larger than it is a 400 "
        "(units such as '512MiB' accepted; default 1 GiB).",
    )
    media_decode_workers: int = Field(
        default=2,
        ge=1,
        le=64,
        description="Threads that decode media at once (audio, images, video frames), and "
        "as many that turn decoded media into the model's inputs (features, patches); more "
        "wait their turn, so large media cannot hold every other request's share of the CPU "
        "or swell the server's memory.",
    )
    max_video_decoded_bytes: ByteCount = Field(
        default=1024 * 1024 * 1024,
        gt=0,
        description="Most memory one video's sampled frames may take decoded (frames x width "
        "x height x 3 bytes), checked from its header before any frame is decoded; more is "
        "refused (400) with a hint to lower the fps (units such as '2GiB' accepted; default: "
        "1GiB).",
    )

    @field_validator("allowed_local_media_path")
    @classmethod
    def _existing_folder(cls, value: str | None) -> str | None:
        if value is not None and not Path(value).is_dir():
            raise ValueError(f"must be an existing folder, got {value!r}")
        return value

    @field_validator("allowed_media_domains")
    @classmethod
    def _host_names(cls, value: list[str]) -> list[str]:
        hosts = []
        for host in value:
            name = host.strip().lower().removesuffix(".")
            if name.startswith("[") and name.endswith("]"):  # an IPv6 address
                name = name[1:-1]
            elif not name or any(c in name for c in "/@:?#"):
                raise ValueError(
                    f"must be host names such as upload.example.org (no scheme, port or "
                    f"path), got {host!r}"
                )
            hosts.append(name)
        return hosts

    @field_validator("limit_mm_per_prompt")
    @classmethod
    def _every_modality(cls, value: dict[MediaModalityName, int]) -> dict[MediaModalityName, int]:
        return _mm_limits(value)
