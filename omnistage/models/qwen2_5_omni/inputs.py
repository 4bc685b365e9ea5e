"""Qwen2.5-Omni's prompt processor: a tokenized prompt and its decoded media → the thinker's
input, as transformers' ``Qwen2_5OmniProcessor`` (5.24) makes it.

The chat template puts one placeholder per medium (``<|audio_bos|><|AUDIO|><|audio_eos|>``,
``<|vision_bos|><|IMAGE|><|vision_eos|>``, ``<|vision_bos|><|VIDEO|><|vision_eos|>``); each
is expanded to one token per encoder output and becomes one ``EncoderInput`` (an AR
request's ``MultiModalItem``):

- audio, resampled to 16 kHz with soxr, through the checkpoint's ``WhisperFeatureExtractor``
  called as the processor calls it (padded to ``chunk_length`` seconds, truncated there, with
  its attention mask); ``input_features`` ``[mel, frames]`` keeps the unpadded frames;
- an image through ``Qwen2VLImageProcessorPil``: ``pixel_values`` ``[patches, C * T * P *
  P]``, ``image_grid_thw`` ``[1, 3]``;
- a video's frames (already sampled, ``Video.fps`` apart) as ``Qwen2VLVideoProcessor``
  makes them, in torch (``omni_video.video_pixels``, no torchvision): ``pixel_values_videos``,
  ``video_grid_thw``; with ``use_audio_in_video`` its audio track's ``input_features`` too,
  the run framed by ``<|audio_bos|>``/``<|audio_eos|>`` inside the vision ones and
  interleaved by ``seconds_per_chunk`` chunks, and ``is_video`` ``[length]`` (bool) saying
  which of the run's tokens are video ones (the rest, audio).

Positions are ``rope_index``'s. Per-request options (vLLM's ``mm_processor_kwargs``):
``use_audio_in_video``, ``fps`` (the rate the frames stand for: the video's own by default),
``min_pixels`` / ``max_pixels`` (images and video frames, as transformers' flat kwargs; each
within the checkpoint's image bounds). Video frames are otherwise held within the
processor's own bounds (``VIDEO_MIN_PIXELS`` .. ``VIDEO_MAX_PIXELS``), not the checkpoint's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from omnistage.errors import CheckpointError, InvalidRequestError
from omnistage.models.invariant_linear import invariant_width
from omnistage.models.media import MediaItem
from omnistage.models.omni_inputs import OmniPromptProcessor, Options, Prepared
from omnistage.models.qwen2_5_omni.config import CHECKPOINT
from omnistage.models.qwen2_5_omni.rope_index import (
    PositionSettings,
    audio_output_length,
    interleaved_layout,
    rope_index,
)

# Qwen2_5OmniProcessor's own video frame bounds (its ``videos_kwargs``), over any config's.
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28


class Qwen25OmniPromptProcessor(OmniPromptProcessor):
    """The ``PromptProcessor`` of a Qwen2.5-Omni folder (``preprocessor_config.json``,
    ``config.json``)."""

    video_min_pixels = VIDEO_MIN_PIXELS
    video_max_pixels = VIDEO_MAX_PIXELS
    rope_index = staticmethod(rope_index)

    def _read_tokens(self, folder: Path) -> None:
        thinker = CHECKPOINT.config(folder).get("thinker_config") or {}
        try:
            self.settings = PositionSettings.from_config(thinker)
            self.audio_bos, self.audio_eos = (
                int(thinker[k]) for k in ("audio_start_token_id", "audio_end_token_id")
            )
            self.vision_bos, self.vision_eos = (
                int(thinker[k]) for k in ("vision_start_token_id", "vision_end_token_id")
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"thinker_config lacks a valid token id: {exc}") from None

    # -- media ----------------------------------------------------------------------------

    def audio_tokens(self, frames: int) -> int:
        return audio_output_length(min(frames, self.features.nb_max_frames))

    def audio_features(self, audio: Any, where: str) -> torch.Tensor:
        """``[mel, frames]``: the unpadded log-mel frames of ``audio``."""
        samples = self._samples(audio, where)
        rate = int(self.features.sampling_rate)
        frames = min(-(-len(samples) // self.features.hop_length), self.features.nb_max_frames)
        if audio_output_length(frames) < 1:
            shortest = 2 * self.features.hop_length + 1
            raise InvalidRequestError(
                where, f"audio is too short: at least {shortest / rate * 1000:.0f} ms are needed"
            )
        # The checkpoint's processor pads every clip to the extractor's 30 s window and
        # keeps the real frames; padding only past the last frame's reach (n_fft + a hop of
        # silence) gives the same frames bit for bit (silence never sets the log-mel's max)
        # at a fraction of the cost -- with at least ``invariant_width`` frames: the frames
        # are the mel filter GEMM's ``m``, and with fewer MKL rounds them otherwise.
        hop = self.features.hop_length
        reach = max(len(samples) + self.features.n_fft + hop, invariant_width() * hop)
        out = self.features(
            samples,
            sampling_rate=rate,
            padding="max_length",
            max_length=min(reach, self.features.n_samples),
            truncation=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        frames = int(out["attention_mask"].sum())
        return out["input_features"][0, :, :frames].contiguous()

    def audio_layout(
        self, grid: list[int], seconds_per_grid: float, audio_tokens: int
    ) -> list[bool]:
        """A video's tokens, then its audio track's, per ``seconds_per_chunk`` chunk."""
        return interleaved_layout(grid, seconds_per_grid, audio_tokens, self.settings)

    def audio(self, audio: Any, where: str) -> Prepared:
        """An audio (or a video's audio track): its features and placeholders."""
        features = self.audio_features(audio, where)
        tokens = [self.settings.audio_token_id] * audio_output_length(features.shape[1])
        return Prepared(tokens, {"input_features": features}, audio_frames=features.shape[1])

    # -- the prompt -----------------------------------------------------------------------

    def prepare_all(self, media: list[MediaItem], opts: Options, field: str) -> list[Prepared]:
        """Each medium, processed on its own."""
        wheres = [f"{field}[{k}]" for k in range(len(media))]
        return [
            self.processing(where, self.prepare, item, opts, where)
            for item, where in zip(media, wheres, strict=True)
        ]

    def prepare(self, item: MediaItem, opts: Options, where: str) -> Prepared:
        """One medium (a video with its audio track under ``use_audio_in_video``)."""
        if item.modality == "image":
            return self.image(item.value, opts, where)
        if item.modality == "video":
            track = None
            if opts.use_audio_in_video:
                track = self.audio(self.audio_track(item.value, where), f"{where}.audio")
            return self.video(item.value, opts, where, track)
        return self.audio(item.value, where)
