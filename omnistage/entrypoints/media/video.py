"""Video bytes decoded into ``Video``: RGB frames sampled uniformly at the requested fps and,
when asked, the audio track.

Before any frame is decoded the container's header bounds the duration
(``--max-video-seconds``), the frame size (``--max-input-image-pixels``), the number of frames
to sample (``--max-video-frames``) and the memory they take decoded, frames x width x height x
3 bytes (``--max-video-decoded-bytes``); each is checked again while decoding, for a header that
says no duration or lies. Every refusal is an ``InvalidRequestError`` naming the field.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from omnistage.entrypoints.media.decode import audio_track, decoding, duration, open_av
from omnistage.entrypoints.media.policy import MediaPolicy, too_long
from omnistage.errors import InvalidRequestError
from omnistage.models.media import DEFAULT_VIDEO_FPS, Video

# Decoded frames per second of a video's length at most (a guard against a stream of
# near-empty frames with a tiny time base; sampled frames are bounded by max_video_frames).
MAX_DECODED_FPS = 240


def decode_video(
    raw: bytes,
    where: str,
    policy: MediaPolicy,
    fps: float = DEFAULT_VIDEO_FPS,
    use_audio: bool = False,
    num_frames: int | None = None,
) -> Video:
    """Video bytes as RGB frames sampled uniformly over the duration at about ``fps`` per
    second, or ``num_frames`` of them (vLLM's ``media_io_kwargs``) when the header says the
    duration (at least one; never more than the source has), with the effective rate in
    ``Video.fps``; and, with ``use_audio``, its audio track (None without one). Duration,
    frame size, the number of sampled frames and their decoded bytes are checked from the
    header before any frame is decoded."""
    frames, step = decoding(
        where, "video", lambda: _sample_frames(raw, where, policy, fps, num_frames)
    )
    audio = None
    if use_audio:
        audio = decoding(
            where, "video's audio", lambda: audio_track(raw, where, policy, "video's audio")
        )
    return Video(frames=frames, fps=1.0 / step, audio=audio)


def _sample_frames(
    raw: bytes, where: str, policy: MediaPolicy, fps: float, num_frames: int | None = None
) -> tuple[np.ndarray, float]:
    """The sampled frames ``[T, H, W, 3]`` and the time between them, in seconds.

    Targets sit at the middle of ``T`` equal spans of the duration (``T`` = duration x fps,
    rounded, at least 1); each takes the decoded frame nearest it. Without a duration in the
    header the targets are ``1 / fps`` apart until the stream ends."""
    with open_av(raw) as container:
        if not container.streams.video:
            raise InvalidRequestError(where, "the video has no video track")
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        width, height = stream.codec_context.width, stream.codec_context.height
        _check_frame_size(width, height, where, policy)
        seconds = duration(stream, container)
        if seconds is not None and seconds > policy.max_video_seconds:
            raise too_long(where, "video", seconds, policy.max_video_seconds, "--max-video-seconds")
        source_rate = float(stream.average_rate or stream.guessed_rate or 0) or None
        count: int | None = None
        if seconds:
            if num_frames is not None:
                fps = num_frames / seconds
            count = max(1, round(seconds * fps))
            # No more samples than the source has frames.
            if stream.frames:
                count = min(count, stream.frames)
            elif source_rate:
                count = min(count, max(1, round(seconds * source_rate)))
            if count > policy.max_video_frames:
                raise _too_many_frames(where, count, fps, policy)
            _check_decoded_bytes(count, width, height, fps, where, policy)
            # Exactly 1 / fps apart when the source has the frames, so ``Video.fps`` is the
            # rate asked for (a processor that turns times into positions needs that rate).
            exact = num_frames is None and count == round(seconds * fps)
            step = 1.0 / fps if exact else seconds / count
        else:
            step = 1.0 / fps
        max_decoded = math.ceil((seconds or policy.max_video_seconds) * MAX_DECODED_FPS) + 1
        picked = _Frames(count, policy, where)
        size: tuple[int, int] | None = None
        start: float | None = None
        previous: tuple[float, Any] | None = None

        def take(frame: Any) -> None:
            nonlocal size
            if size is None:
                size = (frame.width, frame.height)
            if picked.num + 1 > policy.max_video_frames:
                raise _too_many_frames(where, picked.num + 1, fps, policy)
            _check_decoded_bytes(picked.num + 1, *size, fps, where, policy)
            picked.add(frame.reformat(width=size[0], height=size[1], format="rgb24").to_ndarray())

        for decoded, frame in enumerate(container.decode(stream), start=1):
            if decoded > max_decoded:
                raise InvalidRequestError(where, "the video has more frames than its length allows")
            _check_frame_size(frame.width, frame.height, where, policy)
            at = frame.time
            if at is None:
                at = (decoded - 1) / source_rate if source_rate else (decoded - 1) * step
            start = at if start is None else start
            at -= start
            if at > policy.max_video_seconds:
                raise too_long(where, "video", at, policy.max_video_seconds, "--max-video-seconds")
            while (count is None or picked.num < count) and at >= (picked.num + 0.5) * step:
                target = (picked.num + 0.5) * step
                # the earlier frame on a tie
                nearer_previous = (
                    previous is not None and target - previous[0] <= at - target + 1e-9
                )
                take(previous[1] if nearer_previous and previous is not None else frame)
            previous = (at, frame)
            if count is not None and picked.num >= count:
                break
        if previous is None:
            raise InvalidRequestError(where, "the video has no frames")
        # Targets past the last frame's start but within its span take the last frame.
        last_end = previous[0] + (1.0 / source_rate if source_rate else step)
        while (count is None or picked.num < count) and (picked.num + 0.5) * step < last_end:
            take(previous[1])
        if not picked.num:
            take(previous[1])
        return picked.whole(), step


class _Frames:
    """The sampled frames: written into one array of ``count`` frames when the header says
    how many (the peak is the frames once, not a list of them and its stacked copy)."""

    def __init__(self, count: int | None, policy: MediaPolicy, where: str) -> None:
        self.count = count
        self.array: np.ndarray | None = None
        self.items: list[np.ndarray] = []
        self.num = 0
        self.budget, self.where = policy.budget, where

    def add(self, image: np.ndarray) -> None:
        if self.count is not None and self.num < self.count:
            if self.array is None:
                self.array = self._allocate((self.count, *image.shape))
            self.array[self.num] = image
        else:
            self.items.append(image)
        self.num += 1

    def _allocate(self, shape: tuple[int, ...]) -> np.ndarray:
        """The frames' array, counted against the server's budget before it is allocated."""
        nbytes = int(np.prod(shape))
        if self.budget is None:
            return np.empty(shape, np.uint8)
        self.budget.take(nbytes, self.where)
        try:
            array = np.empty(shape, np.uint8)
        except BaseException:
            self.budget.give_back(nbytes)
            raise
        self.budget.attach(array, nbytes)
        return array

    def whole(self) -> np.ndarray:
        if self.array is not None and not self.items:
            return self.array[: self.num]
        kept = [] if self.array is None else list(self.array[: min(self.num, self.count or 0)])
        return np.stack(kept + self.items)


def _check_frame_size(width: int, height: int, where: str, policy: MediaPolicy) -> None:
    if width * height > policy.max_image_pixels:
        raise InvalidRequestError(
            where,
            f"video frames of {width}x{height} pixels are larger than the "
            f"{policy.max_image_pixels} pixels allowed (--max-input-image-pixels)",
        )


def _check_decoded_bytes(
    count: int, width: int, height: int, fps: float, where: str, policy: MediaPolicy
) -> None:
    """``count`` RGB frames of ``width`` x ``height`` within ``--max-video-decoded-bytes``."""
    total = count * width * height * 3
    if total > policy.max_video_decoded_bytes:
        raise InvalidRequestError(
            where,
            f"{count} frames of {width}x{height} pixels sampled at {fps:g} fps take "
            f"{total} bytes decoded, more than the {policy.max_video_decoded_bytes} bytes "
            "allowed (--max-video-decoded-bytes); ask for a lower fps or send a shorter or "
            "smaller video",
        )


def _too_many_frames(where: str, count: int, fps: float, policy: MediaPolicy) -> Exception:
    return InvalidRequestError(
        where,
        f"sampling the video at {fps:g} fps gives {count} frames, more than the "
        f"{policy.max_video_frames} allowed (--max-video-frames); ask for a lower fps",
    )
