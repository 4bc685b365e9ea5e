"""The server's media flags as one value (``MediaPolicy``), and the refusals that name them.

Every limit refused here is an ``InvalidRequestError`` (a 400) naming the offending field and
the flag that sets the limit, as the rest of a bad media part is.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING

from omnistage.entrypoints.media.budget import DecodedBudget
from omnistage.errors import InvalidRequestError
from omnistage.models.media import MODALITIES

if TYPE_CHECKING:
    from omnistage.entrypoints.openai.server_config import ServerConfig


@dataclass(frozen=True)
class MediaPolicy:
    """What a request's media may be and where it may come from (the server's flags).

    The defaults are ``ServerConfig``'s; ``from_config`` builds the policy a server runs with.
    """

    allowed_local_media_path: Path | None = None
    allowed_media_domains: frozenset[str] = frozenset()
    limit_mm_per_prompt: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType(dict.fromkeys(MODALITIES, 4))
    )
    media_fetch_timeout_s: float = 10.0
    max_media_bytes: int = 32 * 1024 * 1024
    max_audio_seconds: float = 600.0
    max_image_pixels: int = 4096 * 4096
    max_video_frames: int = 256
    max_video_seconds: float = 600.0
    max_video_decoded_bytes: int = 1024 * 1024 * 1024
    max_audio_decoded_bytes: int = 600 * 48000 * 4
    decode_workers: int = 2
    # Decoded bytes held across requests (``--max-media-decoded-bytes-in-flight``): the
    # server's one budget, shared by its requests; None: unbounded (the Python API).
    budget: DecodedBudget | None = field(default=None, compare=False)

    @classmethod
    def from_config(cls, cfg: ServerConfig) -> MediaPolicy:
        local = cfg.allowed_local_media_path
        return cls(
            allowed_local_media_path=Path(local).resolve() if local is not None else None,
            allowed_media_domains=frozenset(h.lower() for h in cfg.allowed_media_domains),
            limit_mm_per_prompt=MappingProxyType(
                {str(m): n for m, n in cfg.limit_mm_per_prompt.items()}
            ),
            media_fetch_timeout_s=cfg.media_fetch_timeout_s,
            max_media_bytes=cfg.max_media_bytes,
            max_audio_seconds=cfg.max_audio_seconds,
            max_image_pixels=cfg.max_input_image_pixels,
            max_video_frames=cfg.max_video_frames,
            max_video_seconds=cfg.max_video_seconds,
            max_video_decoded_bytes=cfg.max_video_decoded_bytes,
            max_audio_decoded_bytes=cfg.max_audio_decoded_bytes,
            decode_workers=cfg.media_decode_workers,
            budget=DecodedBudget(cfg.max_media_decoded_bytes_in_flight),
        )


def too_many_bytes(where: str, size: int, policy: MediaPolicy) -> InvalidRequestError:
    return InvalidRequestError(
        where,
        f"media of {size} bytes is larger than the {policy.max_media_bytes} bytes allowed "
        "(--max-media-bytes)",
    )


def too_long(where: str, what: str, seconds: float, limit: float, flag: str) -> InvalidRequestError:
    return InvalidRequestError(
        where, f"{what} of {seconds:.1f} s is longer than the {limit:g} s allowed ({flag})"
    )
