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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from omnistage.errors import CheckpointError, InvalidRequestError
from omnistage.models.ar_config import read_json_object
from omnistage.models.media import MediaItem, ProcessedPrompt
from omnistage.models.omni_inputs import OmniPromptProcessor, Prepared
from omnistage.models.qwen3_omni.config import OmniTokens, read_config
from omnistage.models.qwen3_omni.encoders import audio_output_length
from omnistage.models.qwen3_omni.rope_index import PositionSettings, rope_index

OPTIONS = ("max_pixels", "min_pixels")
MODALITIES = ("audio", "image")
# The tokenizer's names of the run's end tokens, where config.json does not give their ids.
_END_TOKENS = {"audio_end": "<|audio_end|>", "vision_end": "<|vision_end|>"}


@dataclass(frozen=True)
class Options:
    """A request's options (``Qwen3OmniPromptProcessor.options`` checks them)."""

    min_pixels: int | None = None
    max_pixels: int | None = None


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


class Qwen3OmniPromptProcessor(OmniPromptProcessor):
    """The ``PromptProcessor`` of a Qwen3-Omni folder (``preprocessor_config.json``,
    ``config.json``, ``tokenizer.json``)."""

    def __init__(self, folder: str | Path) -> None:
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
        self._media_processors(pre)

    # -- options and the prompt's placeholders --------------------------------------------

    def options(self, options: dict[str, Any]) -> Options:
        """The request's ``mm_processor_kwargs``, checked."""
        self._check_options(options, OPTIONS)
        return Options(**options)

    def placeholders(self, token_ids: list[int], media: list[MediaItem], field: str) -> list[int]:
        """Where each medium's placeholder sits, checked against the media and its framing."""
        for k, item in enumerate(media):
            if item.modality not in MODALITIES:
                raise InvalidRequestError(
                    f"{field}[{k}]", f"this model takes {list(MODALITIES)}, not {item.modality}"
                )
        return super().placeholders(token_ids, media, field)

    # -- media ----------------------------------------------------------------------------

    def resampled(self, audio: Any, where: str) -> np.ndarray:
        """``audio``'s samples at the feature extractor's rate (float32)."""
        samples = self._samples(audio, where)
        rate = int(self.features.sampling_rate)
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
        ids, items = self._expand(token_ids, found, media, prepared)
        positions, delta = rope_index(
            ids,
            self.settings,
            image_grid_thw=[p.grid for p in prepared if p.grid],
            audio_frames=[p.audio_frames for p in prepared if p.audio_frames is not None],
        )
        return ProcessedPrompt(ids, items, positions, delta)
