"""What the omni families' prompt processors (Qwen2.5-Omni's, Qwen3-Omni's) share: the
checkpoint's ``WhisperFeatureExtractor`` and ``Qwen2VLImageProcessorPil``, the checks of the
``mm_processor_kwargs`` pixel bounds, of the prompt's framed placeholders and of an audio's
samples (resampled with soxr), an image's pixels, and the expanded prompt's items.

Each family's ``inputs`` module keeps what is its own: its token ids and positions, its
options, how an audio becomes frames and how many placeholders it takes, video.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from omnistage.errors import InvalidRequestError
from omnistage.models.media import Audio, EncoderInput, MediaItem, content_hash

MAX_ASPECT_RATIO = 200  # smart_resize's
_WHISPER_KEYS = (
    "feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value",
    "dither", "return_attention_mask",
)  # fmt: skip
_IMAGE_KEYS = (
    "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "image_mean",
    "image_std", "do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize",
    "do_convert_rgb",
)  # fmt: skip


@dataclass
class Prepared:
    """One medium, processed: its placeholder tokens, the encoder's data, what the positions
    need (an image's or video's grid and a video's seconds per temporal patch, an audio's mel
    frames), what else changed it (for its hash)."""

    tokens: list[int]
    data: dict[str, torch.Tensor]
    grid: list[int] | None = None
    seconds_per_grid: float | None = None  # a video's
    audio_frames: int | None = None
    framed: bool = False  # the run sits inside <|audio_bos|> .. <|audio_eos|> of its own
    hash_extra: str = ""


class OmniPromptProcessor:
    """The shared part of an omni ``PromptProcessor``; a family's sets ``settings`` (its
    position settings, with ``image_token_id``), ``audio_bos`` / ``audio_eos``,
    ``placeholder_ids`` (modality → token) and ``framing`` (token → its start and end
    tokens), and calls ``_media_processors``."""

    settings: Any
    audio_bos: int
    audio_eos: int
    placeholder_ids: dict[str, int]
    framing: dict[int, tuple[int, int]]

    def _media_processors(self, pre: dict[str, Any]) -> None:
        """The feature extractor and image processor of ``preprocessor_config.json``."""
        from transformers import WhisperFeatureExtractor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        self.features = WhisperFeatureExtractor(**{k: pre[k] for k in _WHISPER_KEYS if k in pre})
        self.images = Qwen2VLImageProcessorPil(**{k: pre[k] for k in _IMAGE_KEYS if k in pre})
        self.min_pixels = int(self.images.size["shortest_edge"])
        self.max_pixels = int(self.images.size["longest_edge"])

    # -- options and the prompt's placeholders --------------------------------------------

    def _check_options(self, options: dict[str, Any], names: tuple[str, ...]) -> None:
        """The request's ``mm_processor_kwargs``: an object of ``names``, each checked
        (``_check_option``), ``min_pixels`` not above ``max_pixels``."""
        prefix = "mm_processor_kwargs"
        if not isinstance(options, dict):
            raise InvalidRequestError(prefix, "must be an object")
        for name, value in options.items():
            where = f"{prefix}.{name}"
            if name not in names:
                raise InvalidRequestError(where, f"unknown option; this model takes {names}")
            self._check_option(name, value, where)
        if (options.get("min_pixels") or 0) > (options.get("max_pixels") or self.max_pixels):
            raise InvalidRequestError(f"{prefix}.min_pixels", "must not exceed max_pixels")

    def _check_option(self, name: str, value: Any, where: str) -> None:
        """One option's value (here the pixel bounds: within the checkpoint's)."""
        if name.endswith("_pixels") and not (
            isinstance(value, int)
            and not isinstance(value, bool)
            and self.min_pixels <= value <= self.max_pixels
        ):
            raise InvalidRequestError(
                where, f"must be an integer in [{self.min_pixels}, {self.max_pixels}]"
            )

    def placeholders(self, token_ids: list[int], media: list[MediaItem], field: str) -> list[int]:
        """Where each medium's placeholder sits, checked against the media and its framing."""
        modality_of = {v: k for k, v in self.placeholder_ids.items()}
        found = [i for i, t in enumerate(token_ids) if t in modality_of]
        if len(found) != len(media):
            raise InvalidRequestError(
                field,
                f"the prompt has {len(found)} media placeholders "
                f"({', '.join(modality_of[token_ids[i]] for i in found) or 'none'}) "
                f"but {len(media)} media were given",
            )
        for k, (at, item) in enumerate(zip(found, media, strict=True)):
            token = token_ids[at]
            if item.modality != modality_of[token]:
                raise InvalidRequestError(
                    f"{field}[{k}]",
                    f"is {item.modality}, but the prompt's placeholder #{k} is for "
                    f"{modality_of[token]}",
                )
            bos, eos = self.framing[token]
            framed = 0 < at < len(token_ids) - 1 and token_ids[at - 1] == bos
            if not framed or token_ids[at + 1] != eos:
                raise InvalidRequestError(
                    f"{field}[{k}]",
                    f"its placeholder (token {at}) must sit between its start and end tokens "
                    f"({bos}, {eos}), as the chat template puts it",
                )
        return found

    # -- media ----------------------------------------------------------------------------

    def _samples(self, audio: Any, where: str) -> np.ndarray:
        """``audio``'s samples at the feature extractor's rate (float32), checked."""
        if not isinstance(audio, Audio):
            raise InvalidRequestError(where, "must be audio")
        samples = np.asarray(audio.samples)
        if samples.ndim != 1 or samples.dtype.kind != "f" or not np.isfinite(samples).all():
            raise InvalidRequestError(where, "audio must be finite mono float samples")
        if audio.sampling_rate <= 0:
            raise InvalidRequestError(where, "audio needs a positive sampling rate")
        rate = int(self.features.sampling_rate)
        samples = samples.astype(np.float32, copy=False)
        if audio.sampling_rate != rate:
            import soxr

            samples = soxr.resample(samples, audio.sampling_rate, rate)
        return samples

    def _target_size(self, height: int, width: int, bounds: tuple[int, int], where: str) -> Any:
        """``smart_resize``'s size of a ``height`` x ``width`` picture within ``bounds``
        pixels, checked."""
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        if min(height, width) < 1 or max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise InvalidRequestError(
                where, f"{width}x{height} pixels: needs sides >= 1 and an aspect ratio <= 200"
            )
        factor = self.images.patch_size * self.images.merge_size
        size = smart_resize(height, width, factor, min_pixels=bounds[0], max_pixels=bounds[1])
        if min(size) < factor:
            raise InvalidRequestError(where, f"{width}x{height} pixels: too small for one patch")
        return size

    def image(self, image: Any, opts: Any, where: str) -> Prepared:
        """An image within the request's pixel bounds (``opts.min_pixels`` /
        ``opts.max_pixels``), else the checkpoint's."""
        from PIL.Image import Image

        if not isinstance(image, Image):
            raise InvalidRequestError(where, "must be an image")
        bounds = (opts.min_pixels or self.min_pixels, opts.max_pixels or self.max_pixels)
        self._target_size(image.height, image.width, bounds, where)
        out = self.images(
            images=[image],
            size={"shortest_edge": bounds[0], "longest_edge": bounds[1]},
            return_tensors="pt",
        )
        grid = [int(v) for v in out["image_grid_thw"][0]]
        count = math.prod(grid) // self.images.merge_size**2
        data = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        extra = f"pixels={bounds}" if opts.min_pixels or opts.max_pixels else ""
        return Prepared([self.settings.image_token_id] * count, data, grid, hash_extra=extra)

    # -- the prompt -----------------------------------------------------------------------

    def _expand(
        self,
        token_ids: list[int],
        found: list[int],
        media: list[MediaItem],
        prepared: list[Prepared],
    ) -> tuple[list[int], list[EncoderInput]]:
        """The prompt with each placeholder (at ``found``) replaced by its medium's tokens
        (framed by ``audio_bos`` / ``audio_eos`` where ``framed``), and the media's items."""
        ids: list[int] = []
        items = []
        cursor = 0
        for at, item, prep in zip(found, media, prepared, strict=True):
            ids += token_ids[cursor:at]
            if prep.framed:
                ids.append(self.audio_bos)
            items.append(self._item(item, prep, len(ids)))
            ids += prep.tokens
            if prep.framed:
                ids.append(self.audio_eos)
            cursor = at + 1
        ids += token_ids[cursor:]
        return ids, items

    @staticmethod
    def _item(media: MediaItem, prep: Prepared, offset: int) -> EncoderInput:
        """The item of one medium whose placeholder run starts at ``offset``. Its hash is the
        medium's, with what else changed what it became (or, for a medium without one, the
        hash of its processed data)."""
        if not media.content_hash:
            parts = [f"{k}:{v.dtype}:{list(v.shape)}" for k, v in sorted(prep.data.items())]
            arrays = [v.contiguous().numpy() for _, v in sorted(prep.data.items())]
            digest = content_hash(media.modality, *parts, *arrays)
        elif prep.hash_extra:
            digest = content_hash(media.content_hash, prep.hash_extra)
        else:
            digest = media.content_hash
        return EncoderInput(media.modality, offset, len(prep.tokens), prep.data, digest)
