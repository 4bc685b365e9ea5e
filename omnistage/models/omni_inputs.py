"""What the omni families' prompt processors (Qwen2.5-Omni's, Qwen3-Omni's) share: the
checkpoint's ``WhisperFeatureExtractor`` and ``Qwen2VLImageProcessorPil``, the request's
options (``mm_processor_kwargs``: ``use_audio_in_video``, ``fps``, ``min_pixels`` /
``max_pixels``) and their checks, the checks of the prompt's framed placeholders and of an
audio's samples (resampled with soxr), an image's pixels, a video's frames patched as
``Qwen2VLVideoProcessor`` patches them (``omni_video.video_pixels``), a video
run interleaved with its audio track's tokens, the expanded prompt's items, and the order of
the work (``process``).

Each family's ``inputs`` module keeps what is its own: its token ids, its positions
(``rope_index``), its processor's own video frame bounds, how an audio becomes frames and how
many placeholders it takes, how a video's audio tokens interleave with its frames'.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

from omnistage.errors import InvalidRequestError
from omnistage.models.ar_config import read_json_object
from omnistage.models.media import (
    Audio,
    EncoderInput,
    MediaItem,
    ProcessedPrompt,
    Video,
    content_hash,
)
from omnistage.models.omni_video import video_pixels

T = TypeVar("T")
OPTIONS = ("fps", "max_pixels", "min_pixels", "use_audio_in_video")

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


@dataclass(frozen=True)
class Options:
    """A request's options (``OmniPromptProcessor.options`` checks them): the video's audio
    track interleaved with its frames, the rate the frames stand for (the video's own by
    default), the pixel bounds of images and video frames."""

    use_audio_in_video: bool = False
    fps: float | None = None
    min_pixels: int | None = None
    max_pixels: int | None = None


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
    """The shared part of an omni ``PromptProcessor``, read from a checkpoint folder; a
    family's sets, in ``_read_tokens``, ``settings`` (its position settings, with
    ``audio_token_id``, ``image_token_id`` and ``video_token_id``), ``audio_bos`` /
    ``audio_eos`` and ``vision_bos`` / ``vision_eos``, and has ``video_min_pixels`` /
    ``video_max_pixels`` (its processor's own video frame bounds), ``rope_index`` (its
    positions, a staticmethod) and ``prepare_all`` (its media, processed)."""

    settings: Any
    audio_bos: int
    audio_eos: int
    vision_bos: int
    vision_eos: int
    placeholder_ids: dict[str, int]
    framing: dict[int, tuple[int, int]]
    video_min_pixels: int
    video_max_pixels: int
    rope_index: Callable[..., tuple[torch.Tensor, int]]

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        pre = read_json_object(folder / "preprocessor_config.json")
        self._read_tokens(folder)
        self._placeholders()
        self._media_processors(pre)

    def _read_tokens(self, folder: Path) -> None:
        """Set ``settings`` and the media tokens' bos and eos ids, from the folder's files."""
        raise NotImplementedError

    def _placeholders(self) -> None:
        """``placeholder_ids`` (modality → token) and ``framing`` (token → its start and end
        tokens) of the settings' audio, image and video tokens."""
        s = self.settings
        audio, vision = (self.audio_bos, self.audio_eos), (self.vision_bos, self.vision_eos)
        self.placeholder_ids = {
            "audio": s.audio_token_id, "image": s.image_token_id, "video": s.video_token_id
        }  # fmt: skip
        self.framing = {s.audio_token_id: audio, s.image_token_id: vision, s.video_token_id: vision}

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

    def options(self, options: dict[str, Any]) -> Options:
        """The request's ``mm_processor_kwargs``: an object of ``OPTIONS``, each checked,
        ``min_pixels`` not above ``max_pixels``."""
        prefix = "mm_processor_kwargs"
        if not isinstance(options, dict):
            raise InvalidRequestError(prefix, "must be an object")
        for name, value in options.items():
            where = f"{prefix}.{name}"
            if name not in OPTIONS:
                raise InvalidRequestError(where, f"unknown option; this model takes {OPTIONS}")
            self._check_option(name, value, where)
        if (options.get("min_pixels") or 0) > (options.get("max_pixels") or self.max_pixels):
            raise InvalidRequestError(f"{prefix}.min_pixels", "must not exceed max_pixels")
        return Options(**options)

    def _check_option(self, name: str, value: Any, where: str) -> None:
        """One option's value (the pixel bounds within the checkpoint's)."""
        if name == "use_audio_in_video" and not isinstance(value, bool):
            raise InvalidRequestError(where, "must be true or false")
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if name == "fps" and not (number and math.isfinite(value) and value > 0):
            raise InvalidRequestError(where, "must be a positive number")
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

    def video(
        self, video: Any, opts: Options, where: str, audio: Prepared | None = None
    ) -> Prepared:
        """A video's frames as ``video_pixels`` patches them, within the request's pixel
        bounds, else the processor's own video bounds (``video_min_pixels`` ..
        ``video_max_pixels``, not the checkpoint's image ones); its temporal patches
        ``temporal_patch_size / fps`` seconds apart (``opts.fps``, else ``Video.fps``). With
        its audio track's ``audio`` (``use_audio_in_video``), one run of both, laid out by
        ``audio_layout``, framed by ``audio_bos`` / ``audio_eos`` inside the vision tokens;
        its data both media's and ``is_video`` (bool, per token)."""
        frames = getattr(video, "frames", None)
        if not isinstance(video, Video) or not isinstance(frames, np.ndarray):
            raise InvalidRequestError(where, "must be a video")
        if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or not frames.size:
            raise InvalidRequestError(where, "video frames must be [T, H, W, 3] uint8, T >= 1")
        fps = opts.fps or video.fps
        if not (isinstance(fps, int | float) and math.isfinite(fps) and fps > 0):
            raise InvalidRequestError(where, "the video needs a positive frame rate")
        self.check_video_rate(len(frames), fps, opts, where)
        bounds = (
            opts.min_pixels or self.video_min_pixels,
            opts.max_pixels or self.video_max_pixels,
        )
        size = self._target_size(frames.shape[1], frames.shape[2], bounds, where)
        ip = self.images
        pixels, grid = video_pixels(frames, tuple(size), ip)
        seconds = ip.temporal_patch_size / fps
        named = {
            f"fps={fps!r}": opts.fps is not None,
            f"pixels={bounds}": opts.min_pixels or opts.max_pixels,
        }
        extra = ";".join(name for name, given in named.items() if given)
        data = {"pixel_values_videos": pixels, "video_grid_thw": torch.tensor([grid])}
        count = math.prod(grid) // ip.merge_size**2
        if audio is None:
            return Prepared([self.settings.video_token_id] * count, data, grid, seconds,
                            hash_extra=extra)  # fmt: skip
        is_video = self.audio_layout(grid, seconds, len(audio.tokens))
        s = self.settings
        tokens = [s.video_token_id if v else s.audio_token_id for v in is_video]
        data |= audio.data | {"is_video": torch.tensor(is_video)}
        extra = ";".join(e for e in (extra, "audio", audio.hash_extra) if e)
        return Prepared(tokens, data, grid, seconds, audio.audio_frames, True, extra)

    def check_video_rate(self, frames: int, fps: float, opts: Options, where: str) -> None:
        """A family's refusal of a frame rate its positions cannot take (none here)."""

    def audio_layout(
        self, grid: list[int], seconds_per_grid: float, audio_tokens: int
    ) -> list[bool]:
        """Which tokens of a video-with-audio run are video ones (the family's layout)."""
        raise NotImplementedError

    @staticmethod
    def audio_track(video: Any, where: str) -> Audio:
        """The audio track ``use_audio_in_video`` interleaves (a 400 for a silent video)."""
        if not isinstance(video, Video):
            raise InvalidRequestError(where, "must be a video")
        if video.audio is None:
            raise InvalidRequestError(
                where, "use_audio_in_video needs the video's audio track; this video has none"
            )
        return video.audio

    @staticmethod
    def processing(where: str, make: Callable[..., T], *args: Any) -> T:
        """``make(*args)``; what the processors refuse (``ValueError``, ``TypeError``) as an
        ``InvalidRequestError`` naming ``where``."""
        try:
            return make(*args)
        except InvalidRequestError:
            raise
        except (ValueError, TypeError) as exc:  # a medium the processors cannot take
            raise InvalidRequestError(where, f"cannot be processed: {exc}") from exc

    # -- the prompt -----------------------------------------------------------------------

    def prepare_all(self, media: list[MediaItem], opts: Options, field: str) -> list[Prepared]:
        raise NotImplementedError

    def audio_tokens(self, frames: int) -> int:
        """Placeholder tokens of ``frames`` log-mel frames (the family's encoder's)."""
        raise NotImplementedError

    def min_tokens(self, media: list[MediaItem]) -> int:
        """A lower bound of the tokens ``media`` expand to, from their lengths alone: what
        refuses an audio too long for the context before it is resampled and featurized
        (10 minutes of audio are hundreds of MB of features). Audio only."""
        total = 0
        rate, hop = int(self.features.sampling_rate), int(self.features.hop_length)
        for item in media:
            value = item.value
            if item.modality != "audio" or not isinstance(value, Audio):
                continue
            if value.sampling_rate <= 0:
                continue  # refused, naming it, when processed
            samples = len(value.samples) * rate // value.sampling_rate - 1  # resampled, at least
            total += max(0, self.audio_tokens(max(0, samples) // hop))
        return total

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
        videos = [p for p in prepared if p.seconds_per_grid is not None]
        positions, delta = self.rope_index(
            ids,
            self.settings,
            image_grid_thw=[p.grid for p in prepared if p.grid and p.seconds_per_grid is None],
            video_grid_thw=[p.grid for p in videos],
            video_seconds_per_grid=[p.seconds_per_grid for p in videos],
            audio_frames=[p.audio_frames for p in prepared if p.audio_frames is not None],
            use_audio_in_video=opts.use_audio_in_video,
        )
        return ProcessedPrompt(ids, items, positions, delta)

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
