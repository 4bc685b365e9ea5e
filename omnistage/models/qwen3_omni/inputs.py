"""Qwen3-Omni's prompt processor: a tokenized prompt and its decoded media → the thinker's input,
as transformers' ``Qwen3OmniMoeProcessor`` (5.24) makes it.

``Qwen3OmniPromptProcessor`` expands each medium's placeholder to one token per encoder output
and makes it one ``EncoderInput``: audio as Whisper features, an image as Qwen2-VL patches, a
video's frames as ``omni_video.video_pixels`` patches them (with ``use_audio_in_video``, its
audio track merged with them by time), and gives the prompt ``rope_index``'s positions (a video
whose patch times are not whole numbers of position ids is a 400 naming ``fps``).
``VIDEO_MIN_PIXELS`` / ``VIDEO_MAX_PIXELS`` are the processor's own frame bounds.

See docs/qwen3-omni.md, "Placing media in the prompt" and "Video".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from omnistage.errors import CheckpointError, InvalidRequestError
from omnistage.models.media import MediaItem
from omnistage.models.omni_inputs import OmniPromptProcessor, Options, Prepared
from omnistage.models.qwen3_omni.config import CHECKPOINT, OmniTokens
from omnistage.models.qwen3_omni.encoders import audio_output_length
from omnistage.models.qwen3_omni.rope_index import (
    PositionSettings,
    has_whole_times,
    rope_index,
    time_order,
)

# Qwen3OmniMoeProcessor's own video frame bounds (its ``videos_kwargs``), over any config's.
VIDEO_MIN_PIXELS = 128 * 32 * 32
VIDEO_MAX_PIXELS = 768 * 32 * 32
# The tokenizer's names of the run's end tokens, where config.json does not give their ids.
_END_TOKENS = {"audio_end": "<|audio_end|>", "vision_end": "<|vision_end|>"}


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

    video_min_pixels = VIDEO_MIN_PIXELS
    video_max_pixels = VIDEO_MAX_PIXELS
    rope_index = staticmethod(rope_index)

    def _read_tokens(self, folder: Path) -> None:
        tokens = OmniTokens.from_config(CHECKPOINT.config(folder))
        per_second = tokens.position_id_per_seconds
        if per_second != int(per_second):
            raise CheckpointError(
                f"thinker_config.position_id_per_seconds {per_second} is not a whole number"
            )
        self.settings = PositionSettings(
            audio_token_id=tokens.audio,
            image_token_id=tokens.image,
            video_token_id=tokens.video,
            spatial_merge_size=tokens.spatial_merge_size,
            position_id_per_seconds=int(per_second),
            audio_n_window=tokens.audio_n_window,
        )
        self.audio_bos, self.vision_bos = tokens.audio_start, tokens.vision_start
        self.audio_eos = _end_token_id(folder, tokens.audio_end, "audio_end")
        self.vision_eos = _end_token_id(folder, tokens.vision_end, "vision_end")

    # -- media ----------------------------------------------------------------------------

    def audio_tokens(self, frames: int) -> int:
        return audio_output_length(frames, self.settings.audio_n_window)

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

    def check_video_rate(self, frames: int, fps: float, opts: Options, where: str) -> None:
        """Refuse a rate at which a video of ``frames`` frames would take fractional time
        positions (transformers keeps them as fractions; ours are whole numbers)."""
        tps = self.images.temporal_patch_size
        seconds = tps / fps
        if has_whole_times(-(-frames // tps), seconds, self.settings):
            return
        per_second = self.settings.position_id_per_seconds
        raise InvalidRequestError(
            "mm_processor_kwargs.fps" if opts.fps else where,
            f"at {fps:g} frames per second a temporal patch of {tps} frames spans "
            f"{seconds * per_second:.6g} position ids ({per_second} per second): its time "
            "positions would be fractional, which this server does not represent; send "
            f"mm_processor_kwargs.fps at which a patch spans whole ids, e.g. {tps} or {tps / 2:g}",
        )

    def audio_layout(
        self, grid: list[int], seconds_per_grid: float, audio_tokens: int
    ) -> list[bool]:
        """A video's tokens and its audio track's merged by time, as the processor's
        ``replace_video_with_audio_token`` lays them out (times in float64)."""
        merge = self.settings.spatial_merge_size
        per_patch = (grid[1] // merge) * (grid[2] // merge)
        per_second = self.settings.position_id_per_seconds
        times = [t * seconds_per_grid * per_second for t in range(grid[0])]
        video = [time for time in times for _ in range(per_patch)]
        return time_order(video, range(audio_tokens))

    # -- the prompt -----------------------------------------------------------------------

    def prepare_all(self, media: list[MediaItem], opts: Options, field: str) -> list[Prepared]:
        """Every medium, processed; the audios, each video's audio track among them with
        ``use_audio_in_video``, padded to the longest of them, as the processor batches
        them."""
        where = [f"{field}[{k}]" for k in range(len(media))]
        samples: dict[int, np.ndarray] = {}
        for k, item in enumerate(media):  # what the processor's audio batch holds
            if item.modality == "audio":
                samples[k] = self.processing(where[k], self.resampled, item.value, where[k])
            elif item.modality == "video" and opts.use_audio_in_video:
                track, at = self.audio_track(item.value, where[k]), f"{where[k]}.audio"
                samples[k] = self.processing(at, self.resampled, track, at)
        longest = max((len(s) for s in samples.values()), default=0)
        return [
            self.processing(where[k], self.prepare, item, opts, where[k], samples.get(k), longest)
            for k, item in enumerate(media)
        ]

    def prepare(
        self, item: MediaItem, opts: Options, where: str, samples: np.ndarray | None, longest: int
    ) -> Prepared:
        """One medium (``samples``: an audio's, or a video's audio track's)."""
        if item.modality == "image":
            return self.image(item.value, opts, where)
        if samples is None:  # a video without its audio track
            return self.video(item.value, opts, where)
        audio = self.audio(samples, longest)
        return audio if item.modality == "audio" else self.video(item.value, opts, where, audio)
