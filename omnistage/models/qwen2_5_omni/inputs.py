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
  makes them, in torch (``video_pixels``, no torchvision): ``pixel_values_videos``,
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

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from omnistage.errors import CheckpointError, InvalidRequestError
from omnistage.models.ar_config import read_json_object
from omnistage.models.media import MediaItem, ProcessedPrompt, Video
from omnistage.models.omni_inputs import OmniPromptProcessor, Prepared
from omnistage.models.qwen2_5_omni.config import read_config
from omnistage.models.qwen2_5_omni.rope_index import (
    PositionSettings,
    audio_output_length,
    interleaved_layout,
    rope_index,
)

# Qwen2_5OmniProcessor's own video frame bounds (its ``videos_kwargs``), over any config's.
VIDEO_MIN_PIXELS = 128 * 28 * 28
VIDEO_MAX_PIXELS = 768 * 28 * 28
OPTIONS = ("fps", "max_pixels", "min_pixels", "use_audio_in_video")


@dataclass(frozen=True)
class Options:
    """A request's options (``Qwen25OmniPromptProcessor.options`` checks them)."""

    use_audio_in_video: bool = False
    fps: float | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None


def video_pixels(
    frames: np.ndarray,
    size: tuple[int, int],
    *,
    mean: list[float],
    std: list[float],
    rescale_factor: float,
    patch_size: int,
    temporal_patch_size: int,
    merge_size: int,
) -> tuple[torch.Tensor, list[int]]:
    """``pixel_values_videos`` ``[t * h * w, C * T * P * P]`` and the grid ``[t, h, w]`` of
    frames ``[T, H, W, 3]`` (uint8), as ``Qwen2VLVideoProcessor`` makes them with torchvision:
    resized to ``size`` (bicubic, antialiased, on uint8) unless already that size; rescaled
    and normalised in one step, ``(x - 255 mean) / (255 std)`` in float32; the frame count
    padded to a multiple of ``temporal_patch_size`` with the last frame; patches ordered by
    time, then merge window, then patch within the window."""
    video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2)
    if tuple(video.shape[-2:]) != size:
        video = F.interpolate(video, size=size, mode="bicubic", align_corners=False, antialias=True)
    scale = 1.0 / rescale_factor
    mean_t = (torch.tensor(mean) * scale).view(-1, 1, 1)
    std_t = (torch.tensor(std) * scale).view(-1, 1, 1)
    video = (video.to(torch.float32) - mean_t) / std_t
    if pad := -len(video) % temporal_patch_size:
        video = torch.cat([video, video[-1:].expand(pad, -1, -1, -1)])
    frames_, channels, height, width = video.shape
    grid = [frames_ // temporal_patch_size, height // patch_size, width // patch_size]
    m, p = merge_size, patch_size
    patches = video.view(
        grid[0], temporal_patch_size, channels, grid[1] // m, m, p, grid[2] // m, m, p
    ).permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return patches.reshape(grid[0] * grid[1] * grid[2], -1), grid


class Qwen25OmniPromptProcessor(OmniPromptProcessor):
    """The ``PromptProcessor`` of a Qwen2.5-Omni folder (``preprocessor_config.json``,
    ``config.json``)."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        pre = read_json_object(folder / "preprocessor_config.json")
        raw = read_config(folder)
        if raw is None:
            raise CheckpointError(f"{folder} is not a Qwen2.5-Omni checkpoint")
        thinker = raw.get("thinker_config") or {}
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
        s = self.settings
        self.placeholder_ids = {
            "audio": s.audio_token_id, "image": s.image_token_id, "video": s.video_token_id
        }  # fmt: skip
        self.framing = {
            s.audio_token_id: (self.audio_bos, self.audio_eos),
            s.image_token_id: (self.vision_bos, self.vision_eos),
            s.video_token_id: (self.vision_bos, self.vision_eos),
        }
        self._media_processors(pre)

    # -- options and the prompt's placeholders --------------------------------------------

    def options(self, options: dict[str, Any]) -> Options:
        """The request's ``mm_processor_kwargs``, checked."""
        self._check_options(options, OPTIONS)
        return Options(**options)

    def _check_option(self, name: str, value: Any, where: str) -> None:
        if name == "use_audio_in_video" and not isinstance(value, bool):
            raise InvalidRequestError(where, "must be true or false")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if name == "fps" and not (number and math.isfinite(value) and value > 0):
            raise InvalidRequestError(where, "must be a positive number")
        super()._check_option(name, value, where)

    # -- media ----------------------------------------------------------------------------

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
        # at a fraction of the cost.
        reach = len(samples) + self.features.n_fft + self.features.hop_length
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

    @staticmethod
    def _video_bounds(opts: Options) -> tuple[int, int]:
        """A video's frame pixel bounds: the request's, else the processor's own."""
        return opts.min_pixels or VIDEO_MIN_PIXELS, opts.max_pixels or VIDEO_MAX_PIXELS

    def video(self, video: Any, opts: Options, where: str) -> Prepared:
        frames = getattr(video, "frames", None)
        if not isinstance(video, Video) or not isinstance(frames, np.ndarray):
            raise InvalidRequestError(where, "must be a video")
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or not frames.size:
            raise InvalidRequestError(where, "video frames must be [T, H, W, 3] uint8, T >= 1")
        fps = opts.fps or video.fps
        if not (isinstance(fps, int | float) and math.isfinite(fps) and fps > 0):
            raise InvalidRequestError(where, "the video needs a positive frame rate")
        bounds = self._video_bounds(opts)
        size = self._target_size(frames.shape[1], frames.shape[2], bounds, where)
        ip = self.images
        pixels, grid = video_pixels(
            frames, tuple(size), mean=list(ip.image_mean), std=list(ip.image_std),
            rescale_factor=ip.rescale_factor, patch_size=ip.patch_size,
            temporal_patch_size=ip.temporal_patch_size, merge_size=ip.merge_size,
        )  # fmt: skip
        seconds = ip.temporal_patch_size / fps
        data = {"pixel_values_videos": pixels, "video_grid_thw": torch.tensor([grid])}
        count = math.prod(grid) // ip.merge_size**2
        extra = ";".join(
            part
            for part, given in [
                (f"fps={fps!r}", opts.fps is not None),
                (f"pixels={bounds}", bool(opts.min_pixels or opts.max_pixels)),
                ("audio", opts.use_audio_in_video),
            ]
            if given
        )
        if not opts.use_audio_in_video:
            tokens = [self.settings.video_token_id] * count
            return Prepared(tokens, data, grid, seconds, hash_extra=extra)
        if video.audio is None:
            raise InvalidRequestError(
                where, "use_audio_in_video needs the video's audio track; this video has none"
            )
        features = self.audio_features(video.audio, f"{where}.audio")
        is_video = interleaved_layout(
            grid, seconds, audio_output_length(features.shape[1]), self.settings
        )
        s = self.settings
        tokens = [s.video_token_id if v else s.audio_token_id for v in is_video]
        data |= {"input_features": features, "is_video": torch.tensor(is_video)}
        return Prepared(tokens, data, grid, seconds, features.shape[1], True, extra)

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
        prepared = [self.prepare(item, opts, f"{field}[{k}]") for k, item in enumerate(media)]
        ids, items = self._expand(token_ids, found, media, prepared)
        positions, delta = rope_index(
            ids,
            self.settings,
            image_grid_thw=[p.grid for p in prepared if p.grid and p.seconds_per_grid is None],
            video_grid_thw=[p.grid for p in prepared if p.grid and p.seconds_per_grid is not None],
            video_seconds_per_grid=[p.seconds_per_grid for p in prepared if p.seconds_per_grid],
            audio_frames=[p.audio_frames for p in prepared if p.audio_frames is not None],
            use_audio_in_video=opts.use_audio_in_video,
        )
        return ProcessedPrompt(ids, items, positions, delta)

    def prepare(self, item: MediaItem, opts: Options, where: str) -> Prepared:
        """One medium, processed; what the processors refuse is an ``InvalidRequestError``."""
        try:
            if item.modality == "image":
                return self.image(item.value, opts, where)
            if item.modality == "video":
                return self.video(item.value, opts, where)
            features = self.audio_features(item.value, where)
        except InvalidRequestError:
            raise
        except (ValueError, TypeError) as exc:  # a medium the processors cannot take
            raise InvalidRequestError(where, f"cannot be processed: {exc}") from exc
        tokens = [self.settings.audio_token_id] * audio_output_length(features.shape[1])
        return Prepared(tokens, {"input_features": features}, audio_frames=features.shape[1])
