"""Decoded media, as a prompt brings it to a model family's prompt processor.

The API process decodes what a request sends (``omnistage.entrypoints.media``: data URLs,
allowed files and domains, size and duration limits) into these plain values; a family's
``PromptProcessor`` turns them, with the tokenized prompt, into the model's input (placeholder
tokens expanded, encoder inputs, positions). Nothing here imports torch or a model.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from omnistage.errors import InvalidRequestError

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

Modality = Literal["audio", "image", "video"]
MODALITIES: tuple[Modality, ...] = ("audio", "image", "video")


@dataclass(frozen=True)
class Audio:
    """Mono float32 samples in [-1, 1] at ``sampling_rate`` Hz."""

    samples: np.ndarray
    sampling_rate: int

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.sampling_rate


@dataclass(frozen=True)
class Video:
    """Frames ``[T, H, W, 3]`` uint8 RGB, sampled at ``fps`` frames per second of the source,
    and the source's audio track (when it has one and it was asked for)."""

    frames: np.ndarray
    fps: float
    audio: Audio | None = None


@dataclass(frozen=True)
class MediaItem:
    """One non-text part of a prompt, in prompt order. ``content_hash`` names the raw bytes
    (the encoder cache's key, and the prefix cache's for its placeholders)."""

    modality: Modality
    value: Audio | Image | Video
    content_hash: str = ""
    options: dict[str, Any] = field(default_factory=dict)


def content_hash(*parts: bytes | np.ndarray | str) -> str:
    """A stable hash of raw media (bytes, arrays, or describing strings)."""
    digest = hashlib.blake2b(digest_size=16)
    for part in parts:
        if isinstance(part, np.ndarray):
            digest.update(str((part.dtype, part.shape)).encode())
            digest.update(np.ascontiguousarray(part).tobytes())
        elif isinstance(part, str):
            digest.update(part.encode())
        else:
            digest.update(part)
    return digest.hexdigest()


@dataclass
class EncoderInput:
    """One medium made ready for the model's encoder (an AR request's ``MultiModalItem``):
    its placeholder tokens sit at ``offset`` .. ``offset + length`` of the prompt, ``data``
    is what the encoder of ``modality`` takes (tensors by name)."""

    modality: str
    offset: int
    length: int
    data: dict[str, torch.Tensor]
    content_hash: str = ""


@dataclass
class ProcessedPrompt:
    """A prompt made ready for the model: its token ids with every placeholder expanded, its
    multimodal items (encoder inputs and where their placeholders sit), and, for a model with
    multimodal rotary positions, the positions ``[3, len(token_ids)]`` of the prompt and the
    offset every generated token's position has from its index (``position_delta``)."""

    token_ids: list[int]
    items: list[EncoderInput]
    positions: torch.Tensor | None = None
    position_delta: int = 0


class PromptProcessor(Protocol):
    """A model family's processor of multimodal prompts (built from the checkpoint folder).

    ``placeholder_ids``: per modality the token id a chat template or a prompt puts once per
    item; ``process`` expands each into the item's placeholder tokens and makes the encoder
    inputs, as the checkpoint's own processor does. Raises ``InvalidRequestError`` naming the
    offending part (a field under ``field``)."""

    placeholder_ids: dict[str, int]

    def process(
        self,
        token_ids: list[int],
        media: list[MediaItem],
        options: dict[str, Any],
        field: str = "multi_modal_data",
    ) -> ProcessedPrompt: ...

    def min_tokens(self, media: list[MediaItem]) -> int:
        """A lower bound of the placeholder tokens ``media`` expand to, from their lengths
        alone (0 where the family cannot tell cheaply): what refuses a prompt too long for
        the context before its media are processed."""
        ...


# -- already decoded media (vLLM's multi_modal_data) ----------------------------------------

# Frames per second a video is taken as sampled at unless it says (the HTTP layer's default
# too: the default of common video processors).
DEFAULT_VIDEO_FPS = 2.0


def media_items(data: Any, field: str = "multi_modal_data") -> list[MediaItem]:
    """vLLM's ``multi_modal_data`` of a Python prompt as media items: ``audio`` a ``(samples,
    rate)`` tuple or a list of them; ``image`` a PIL image (or an ``[H, W, 3]`` uint8 array) or
    a list; ``video`` frames (an ``[T, H, W, 3]`` uint8 array or a list of PIL images),
    optionally as ``(frames, {"fps": x})`` or ``(frames, x)`` (else ``DEFAULT_VIDEO_FPS``), or a
    list of videos.

    The items come in the order audio, image, video, each modality's as given: the order their
    placeholders must have in the prompt. Samples become mono float32 in [-1, 1] (integer PCM
    scaled from its full range), images RGB (transparency over white); content hashes come from
    the decoded arrays and pixels. A wrong value is an ``InvalidRequestError`` naming it
    (``multi_modal_data.audio[0]``).
    """
    if not isinstance(data, Mapping):
        raise InvalidRequestError(field, "must be a mapping of modality to media")
    unknown = sorted(str(k) for k in data if k not in MODALITIES)
    if unknown:
        raise InvalidRequestError(
            f"{field}.{unknown[0]}", f"unknown modality; expected one of {list(MODALITIES)}"
        )
    items: list[MediaItem] = []
    for modality in MODALITIES:
        if data.get(modality) is None:
            continue
        for where, value in _listed(modality, data[modality], f"{field}.{modality}"):
            if modality == "audio":
                audio = _audio_value(value, where)
                digest = content_hash("audio", audio.samples, str(audio.sampling_rate))
                items.append(MediaItem("audio", audio, digest))
            elif modality == "image":
                image = _image_value(value, where)
                items.append(MediaItem("image", image, content_hash("image", np.asarray(image))))
            else:
                video = _video_value(value, where)
                digest = content_hash("video", video.frames, f"fps={video.fps!r}")
                items.append(MediaItem("video", video, digest, {"fps": video.fps}))
    return items


def rgb_image(image: Image) -> Image:
    """A Pillow image as RGB, what is transparent in it over white (as vLLM converts)."""
    from PIL import Image as PILImage

    if image.mode in ("RGBA", "LA", "PA") or "transparency" in image.info:
        rgba = image.convert("RGBA")
        rgb = PILImage.new("RGB", rgba.size, (255, 255, 255))
        rgb.paste(rgba, mask=rgba.getchannel("A"))
        return rgb
    return image if image.mode == "RGB" else image.convert("RGB")


def mono_audio(samples: np.ndarray, rate: int, *, in_place: bool = False) -> Audio:
    """Float samples ``[frames, channels]`` (or ``[frames]``) as mono float32 in [-1, 1];
    ``in_place``: a decoder's own float32 buffer is clipped where it is (no second copy)."""
    mono = samples.mean(axis=1) if samples.ndim == 2 else samples
    mono = mono.astype(np.float32, copy=False)
    if in_place and mono.flags.writeable:
        return Audio(np.clip(mono, -1.0, 1.0, out=mono), int(rate))
    return Audio(np.clip(mono, -1.0, 1.0), int(rate))


def _is_pil(value: Any) -> bool:
    from PIL.Image import Image as PILImage

    return isinstance(value, PILImage)


def _listed(modality: Modality, value: Any, where: str) -> list[tuple[str, Any]]:
    """One item or a list of items, each with its field name (``...audio[0]``)."""
    single = (
        (modality == "audio" and isinstance(value, tuple))
        or (modality == "image" and (_is_pil(value) or isinstance(value, np.ndarray)))
        or (
            modality == "video"
            and (
                isinstance(value, np.ndarray | tuple)
                or (isinstance(value, list) and bool(value) and all(map(_is_pil, value)))
            )
        )
    )
    if single:
        return [(where, value)]
    if not isinstance(value, list):
        raise InvalidRequestError(where, f"must be one {modality} item or a list of them")
    return [(f"{where}[{i}]", v) for i, v in enumerate(value)]


def _audio_value(value: Any, where: str) -> Audio:
    if not (isinstance(value, tuple) and len(value) == 2):
        raise InvalidRequestError(where, "must be a (samples, sampling_rate) tuple")
    samples, rate = value
    if isinstance(rate, bool) or not isinstance(rate, int | np.integer) or rate <= 0:
        raise InvalidRequestError(where, f"sampling rate must be a positive int, got {rate!r}")
    if not isinstance(samples, np.ndarray) or samples.dtype.kind not in "fiu":
        raise InvalidRequestError(where, "samples must be a numpy array of numbers")
    if samples.ndim == 2:  # [frames, channels] or [channels, frames]: channels is the short axis
        if min(samples.shape) > 8:
            raise InvalidRequestError(
                where, f"samples of shape {samples.shape} are not [frames] or [frames, channels]"
            )
        samples = samples if samples.shape[1] <= samples.shape[0] else samples.T
    elif samples.ndim != 1:
        raise InvalidRequestError(where, f"samples must be 1-D (mono), got shape {samples.shape}")
    if samples.size == 0:
        raise InvalidRequestError(where, "samples are empty")
    if samples.dtype.kind == "f":
        floats = samples.astype(np.float32)
        if not np.isfinite(floats).all():
            raise InvalidRequestError(where, "samples must be finite")
    elif samples.dtype.kind == "i":  # PCM integers: full scale is 1.0
        floats = (samples / float(2 ** (8 * samples.dtype.itemsize - 1))).astype(np.float32)
    else:  # unsigned PCM: silence at half the range
        half = float(2 ** (8 * samples.dtype.itemsize - 1))
        floats = ((samples - half) / half).astype(np.float32)
    return mono_audio(floats, int(rate))


def _image_value(value: Any, where: str) -> Image:
    from PIL import Image as PILImage

    if isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim != 3 or value.shape[2] != 3:
            raise InvalidRequestError(
                where, f"an image array must be [H, W, 3] uint8, got {value.dtype} {value.shape}"
            )
        return PILImage.fromarray(value, "RGB")
    if not _is_pil(value):
        raise InvalidRequestError(where, f"must be a PIL image, got {type(value).__name__}")
    return rgb_image(value)


def _video_value(value: Any, where: str) -> Video:
    fps: Any = DEFAULT_VIDEO_FPS
    if isinstance(value, tuple):  # vLLM's (frames, metadata), or (frames, fps)
        if len(value) != 2 or not isinstance(value[1], Mapping | int | float | np.number):
            raise InvalidRequestError(where, "must be frames, (frames, metadata) or (frames, fps)")
        value, metadata = value
        fps = metadata.get("fps", fps) if isinstance(metadata, Mapping) else metadata
        if (
            isinstance(fps, bool)
            or not isinstance(fps, int | float | np.number)
            or not math.isfinite(fps)
            or fps <= 0
        ):
            raise InvalidRequestError(f"{where}.fps", f"must be a positive number, got {fps!r}")
    if isinstance(value, list) and value and all(map(_is_pil, value)):
        value = np.stack([np.asarray(_image_value(f, where)) for f in value])
    if not (
        isinstance(value, np.ndarray)
        and value.dtype == np.uint8
        and value.ndim == 4
        and value.shape[3] == 3
        and value.shape[0] > 0
    ):
        shape = getattr(value, "shape", None)
        raise InvalidRequestError(
            where,
            "must be frames [T, H, W, 3] uint8 (T >= 1) or a list of PIL images, got "
            f"{type(value).__name__}" + (f" {value.dtype} {shape}" if shape is not None else ""),
        )
    return Video(frames=value, fps=float(fps))
