"""Decoded media, as a prompt brings it to a model family's prompt processor.

The API process decodes what a request sends (``omnistage.entrypoints.media``: data URLs,
allowed files and domains, size and duration limits) into these plain values; a family's
``PromptProcessor`` turns them, with the tokenized prompt, into the model's input (placeholder
tokens expanded, encoder inputs, positions). Nothing here imports torch or a model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

if TYPE_CHECKING:
    import torch
    from PIL.Image import Image

    from omnistage.stage.ar.wire import MultiModalItem

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
class ProcessedPrompt:
    """A prompt made ready for the model: its token ids with every placeholder expanded, its
    multimodal items (encoder inputs and where their placeholders sit), and, for a model with
    multimodal rotary positions, the positions ``[3, len(token_ids)]`` of the prompt and the
    offset every generated token's position has from its index (``position_delta``)."""

    token_ids: list[int]
    items: list[MultiModalItem]
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
