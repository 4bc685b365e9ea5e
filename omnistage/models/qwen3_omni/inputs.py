"""Qwen3-Omni's prompt processor: a tokenized prompt and its decoded media → the thinker's input,
as transformers' ``Qwen3OmniMoeProcessor`` (5.24) makes it.

The chat template puts one placeholder per medium (``<|audio_start|><|audio_pad|>
<|audio_end|>``, ``<|vision_start|><|image_pad|><|vision_end|>``); each is expanded to one
token per encoder output and becomes one ``EncoderInput`` (an AR request's
``MultiModalItem``):

- audio, resampled to 16 kHz with soxr, through the checkpoint's ``WhisperFeatureExtractor``
  called as the processor calls it (padded to the longest audio of the prompt, never
  truncated, with its attention mask); ``input_features`` ``[mel, frames]`` keeps the
  unpadded frames, and the placeholders number ``_get_feat_extract_output_lengths`` of them
  (13 per whole chunk of ``2 * n_window`` frames, and the rest's 8x downsampling);
- an image through ``Qwen2VLImageProcessorPil``: ``pixel_values`` ``[patches, C * T * P *
  P]``, ``image_grid_thw`` ``[1, 3]``.

Video is not taken (transformers' video processor needs torchvision, and its positions are
fractional in general; see ``rope_index``). Positions are ``rope_index``'s. Per-request
options (vLLM's ``mm_processor_kwargs``): ``min_pixels`` / ``max_pixels`` (images, within the
checkpoint's bounds).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from omnistage.errors import CheckpointError, InvalidRequestError
from omnistage.models.ar_config import read_json_object
from omnistage.models.media import Audio, EncoderInput, MediaItem, ProcessedPrompt, content_hash
from omnistage.models.qwen3_omni.config import OmniTokens, read_config
from omnistage.models.qwen3_omni.encoders import audio_output_length
from omnistage.models.qwen3_omni.rope_index import PositionSettings, rope_index

OPTIONS = ("max_pixels", "min_pixels")
MAX_ASPECT_RATIO = 200  # smart_resize's
MODALITIES = ("audio", "image")
_WHISPER_KEYS = (
    "feature_size", "sampling_rate", "hop_length", "chunk_length", "n_fft", "padding_value",
    "dither", "return_attention_mask",
)  # fmt: skip
_IMAGE_KEYS = (
    "min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size", "image_mean",
    "image_std", "do_resize", "resample", "do_rescale", "rescale_factor", "do_normalize",
    "do_convert_rgb",
)  # fmt: skip
# The tokenizer's names of the run's end tokens, where config.json does not give their ids.
_END_TOKENS = {"audio_end": "<|audio_end|>", "vision_end": "<|vision_end|>"}


@dataclass(frozen=True)
class Options:
    """A request's options (``Qwen3OmniPromptProcessor.options`` checks them)."""

    min_pixels: int | None = None
    max_pixels: int | None = None


@dataclass
class Prepared:
    """One medium, processed: its placeholder tokens, the encoder's data, what the positions
    need (a picture's grid, an audio's mel frames), what else changed it (for its hash)."""

    tokens: list[int]
    data: dict[str, torch.Tensor]
    grid: list[int] | None = None
    audio_frames: int | None = None
    hash_extra: str = ""


def _end_token_id(folder: Path, configured: int | None, name: str) -> int:
    """A run's end token id: config.json's, else the tokenizer's ``<|..._end|>``."""
    if configured is not None:
        return configured
    try:
        vocab = json.loads((folder / "tokenizer.json").read_text())
        token = _END_TOKENS[name]
        found = [t["id"] for t in vocab.get("added_tokens", []) if t.get("content") == token]
        return int(found[0]) if found else int(vocab["model"]["vocab"][token])
    except (OSError, ValueError, KeyError, TypeError):
        raise CheckpointError(
            f"{folder}: config.json has no thinker_config.{name}_token_id and tokenizer.json "
            f"no {_END_TOKENS[name]} token"
        ) from None


class Qwen3OmniPromptProcessor:
    """The ``PromptProcessor`` of a Qwen3-Omni folder (``preprocessor_config.json``,
    ``config.json``, ``tokenizer.json``)."""

    def __init__(self, folder: str | Path) -> None:
        from transformers import WhisperFeatureExtractor
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil,
        )

        folder = Path(folder)
        pre = read_json_object(folder / "preprocessor_config.json")
        raw = read_config(folder)
        if raw is None:
            raise CheckpointError(f"{folder} is not a Qwen3-Omni checkpoint")
        tokens = OmniTokens.from_config(raw)
        per_second = tokens.position_id_per_seconds
        if per_second != int(per_second):
            raise CheckpointError(
                f"thinker_config.position_id_per_seconds {per_second} is not a whole number"
            )
        self.settings = PositionSettings(
            audio_token_id=tokens.audio,
            image_token_id=tokens.image,
            spatial_merge_size=tokens.spatial_merge_size,
            position_id_per_seconds=int(per_second),
            audio_n_window=tokens.audio_n_window,
        )
        self.audio_bos, self.vision_bos = tokens.audio_start, tokens.vision_start
        self.audio_eos = _end_token_id(folder, tokens.audio_end, "audio_end")
        self.vision_eos = _end_token_id(folder, tokens.vision_end, "vision_end")
        self.placeholder_ids = {"audio": tokens.audio, "image": tokens.image}
        self.framing = {
            tokens.audio: (self.audio_bos, self.audio_eos),
            tokens.image: (self.vision_bos, self.vision_eos),
        }
        self.features = WhisperFeatureExtractor(**{k: pre[k] for k in _WHISPER_KEYS if k in pre})
        self.images = Qwen2VLImageProcessorPil(**{k: pre[k] for k in _IMAGE_KEYS if k in pre})
        self.min_pixels = int(self.images.size["shortest_edge"])
        self.max_pixels = int(self.images.size["longest_edge"])

    # -- options and the prompt's placeholders --------------------------------------------

    def options(self, options: dict[str, Any]) -> Options:
        """The request's ``mm_processor_kwargs``, checked."""
        prefix = "mm_processor_kwargs"
        if not isinstance(options, dict):
            raise InvalidRequestError(prefix, "must be an object")
        for name, value in options.items():
            where = f"{prefix}.{name}"
            if name not in OPTIONS:
                raise InvalidRequestError(where, f"unknown option; this model takes {OPTIONS}")
            if not (
                isinstance(value, int)
                and not isinstance(value, bool)
                and self.min_pixels <= value <= self.max_pixels
            ):
                raise InvalidRequestError(
                    where, f"must be an integer in [{self.min_pixels}, {self.max_pixels}]"
                )
        opts = Options(**options)
        if (opts.min_pixels or 0) > (opts.max_pixels or self.max_pixels):
            raise InvalidRequestError(f"{prefix}.min_pixels", "must not exceed max_pixels")
        return opts

    def placeholders(self, token_ids: list[int], media: list[MediaItem], field: str) -> list[int]:
        """Where each medium's placeholder sits, checked against the media and its framing."""
        for k, item in enumerate(media):
            if item.modality not in MODALITIES:
                raise InvalidRequestError(
                    f"{field}[{k}]", f"this model takes {list(MODALITIES)}, not {item.modality}"
                )
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

    def resampled(self, audio: Any, where: str) -> np.ndarray:
        """``audio``'s samples at the feature extractor's rate (float32)."""
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
        if len(samples) < self.features.hop_length:
            shortest = self.features.hop_length / rate * 1000
            raise InvalidRequestError(
                where, f"audio is too short: at least {shortest:.0f} ms are needed"
            )
        return samples

    def audio(self, samples: np.ndarray, longest: int) -> Prepared:
        """``[mel, frames]``: the unpadded log-mel frames of ``samples``, computed as the
        processor computes them in a batch padded (with zeros) to ``longest`` samples."""
        out = self.features(
            samples,
            sampling_rate=int(self.features.sampling_rate),
            padding="max_length",
            max_length=longest,
            truncation=False,
            return_attention_mask=True,
            return_tensors="pt",
        )
        frames = int(out["attention_mask"].sum())
        features = out["input_features"][0, :, :frames].contiguous()
        count = audio_output_length(frames, self.settings.audio_n_window)
        extra = f"padded={longest}" if longest != len(samples) else ""
        return Prepared([self.settings.audio_token_id] * count, {"input_features": features},
                        audio_frames=frames, hash_extra=extra)  # fmt: skip

    def image(self, image: Any, opts: Options, where: str) -> Prepared:
        from PIL.Image import Image
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        if not isinstance(image, Image):
            raise InvalidRequestError(where, "must be an image")
        low, high = opts.min_pixels or self.min_pixels, opts.max_pixels or self.max_pixels
        height, width = image.height, image.width
        if min(height, width) < 1 or max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
            raise InvalidRequestError(
                where, f"{width}x{height} pixels: needs sides >= 1 and an aspect ratio <= 200"
            )
        factor = self.images.patch_size * self.images.merge_size
        if min(smart_resize(height, width, factor, min_pixels=low, max_pixels=high)) < factor:
            raise InvalidRequestError(where, f"{width}x{height} pixels: too small for one patch")
        out = self.images(
            images=[image],
            size={"shortest_edge": low, "longest_edge": high},
            return_tensors="pt",
        )
        grid = [int(v) for v in out["image_grid_thw"][0]]
        count = math.prod(grid) // self.images.merge_size**2
        data = {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"]}
        extra = f"pixels={(low, high)}" if opts.min_pixels or opts.max_pixels else ""
        return Prepared([self.settings.image_token_id] * count, data, grid, hash_extra=extra)

    def prepare_all(self, media: list[MediaItem], opts: Options, field: str) -> list[Prepared]:
        """Every medium, processed (the audios padded to the longest of them, as the
        processor batches them); what the processors refuse is an ``InvalidRequestError``."""
        where = [f"{field}[{k}]" for k in range(len(media))]
        try:
            samples = {
                k: self.resampled(item.value, where[k])
                for k, item in enumerate(media)
                if item.modality == "audio"
            }
            longest = max((len(s) for s in samples.values()), default=0)
            return [
                self.audio(samples[k], longest)
                if k in samples
                else self.image(item.value, opts, where[k])
                for k, item in enumerate(media)
            ]
        except InvalidRequestError:
            raise
        except (ValueError, TypeError) as exc:  # a medium the processors cannot take
            raise InvalidRequestError(field, f"cannot be processed: {exc}") from exc

    # -- the prompt -----------------------------------------------------------------------

    def process(
        self,
        token_ids: list[int],
        media: list[MediaItem],
        options: dict[str, Any],
        field: str = "multi_modal_data",
    ) -> ProcessedPrompt:
        """The expanded prompt, its items and positions (``InvalidRequestError`` naming the
        offending option, medium or placeholder)."""
        opts = self.options(options)
        found = self.placeholders(list(token_ids), media, field)
        prepared = self.prepare_all(media, opts, field)
        ids: list[int] = []
        items = []
        cursor = 0
        for at, item, prep in zip(found, media, prepared, strict=True):
            ids += token_ids[cursor:at]
            items.append(self._item(item, prep, len(ids)))
            ids += prep.tokens
            cursor = at + 1
        ids += token_ids[cursor:]
        positions, delta = rope_index(
            ids,
            self.settings,
            image_grid_thw=[p.grid for p in prepared if p.grid],
            audio_frames=[p.audio_frames for p in prepared if p.audio_frames is not None],
        )
        return ProcessedPrompt(ids, items, positions, delta)

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
