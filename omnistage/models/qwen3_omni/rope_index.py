"""Qwen3-Omni's 3-D rotary positions of one prompt, as transformers'
``Qwen3OmniMoePreTrainedModelForConditionalGeneration.get_rope_index`` computes them for one
unpadded prompt of text, audio, pictures and video (transformers 5.24/5.25).

``rope_index`` walks the prompt's pieces (``omni_rope``) with Qwen3-Omni's placement: text and
audio count up, a picture's or video's run takes its merged patch grid (``vision_positions``,
times from ``video_times``), a video with its audio track merges both runs by time
(``time_order``). transformers' quirks are kept so that the positions equal its own; they are
integers, so a video whose times are not whole (``has_whole_times``) is refused by the
processor, never rounded.

See docs/qwen3-omni.md, "Rotary positions".
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnistage.models import omni_rope
from omnistage.models.qwen3_omni.encoders import audio_output_length


@dataclass(frozen=True)
class PositionSettings:
    """What the positions depend on besides the prompt: its placeholder ids, the merge size
    of the vision encoder, the time scale and the audio encoder's chunking."""

    audio_token_id: int
    image_token_id: int
    video_token_id: int
    spatial_merge_size: int = 2
    position_id_per_seconds: int = 13
    audio_n_window: int = 50


def video_times(grid_t: int, seconds_per_grid: float, settings: PositionSettings) -> torch.Tensor:
    """``[grid_t]`` time positions of a video's temporal patches, in transformers' float32
    arithmetic: ``arange(grid_t) * float32(seconds_per_grid) * position_id_per_seconds``."""
    seconds = torch.tensor(seconds_per_grid, dtype=torch.float32)
    return torch.arange(grid_t) * seconds * settings.position_id_per_seconds


def has_whole_times(grid_t: int, seconds_per_grid: float, settings: PositionSettings) -> bool:
    """Whether a video's time positions are whole numbers (the ones served)."""
    times = video_times(grid_t, seconds_per_grid, settings)
    return bool(torch.equal(times, times.round()))


def time_order(video: Sequence[float], audio: Sequence[float]) -> list[bool]:
    """Two non-decreasing streams of times merged, as transformers merges a video's tokens
    with its audio track's (``replace_video_with_audio_token``, ``get_rope_index``): True
    for the next video token, False for the next audio token; a video token goes first
    unless its time is after the audio token's; each stream's rest follows when the other
    has run out."""
    order: list[bool] = []
    v = a = 0
    while v < len(video) and a < len(audio):
        first = video[v] <= audio[a]
        order.append(first)
        v, a = (v + 1, a) if first else (v, a + 1)
    return order + [True] * (len(video) - v) + [False] * (len(audio) - a)


def vision_positions(
    start: int, time: torch.Tensor, grid: Sequence[int], merge: int
) -> torch.Tensor:
    """``[3, T * h * w / merge^2]`` positions of a merged patch grid (time-major, then rows,
    then columns) whose time values are ``time`` [T], all offset by ``start``."""
    h, w = int(grid[1]) // merge, int(grid[2]) // merge
    t_rows = time.view(-1, 1).expand(-1, h * w).flatten()
    h_rows = torch.arange(h).view(1, -1, 1).expand(len(time), -1, w).flatten()
    w_rows = torch.arange(w).view(1, 1, -1).expand(len(time), h, -1).flatten()
    return torch.stack([t_rows, h_rows, w_rows]) + start


class _Pieces(omni_rope.Pieces):
    settings: PositionSettings

    def place(self, token: int, start: int, interleaved: bool) -> int:
        settings, media = self.settings, self.media
        merge = settings.spatial_merge_size
        if token == settings.audio_token_id:
            length = audio_output_length(next(media.audios), settings.audio_n_window)
            self.counting(length)
        elif token == settings.image_token_id:
            grid = next(media.images)
            time = torch.arange(int(grid[0])) * settings.position_id_per_seconds
            self.add(vision_positions(self.next, time, grid, merge))
            length = int(grid[0]) * int(grid[1]) * int(grid[2]) // merge**2
        else:
            grid, seconds = next(media.videos)
            times = video_times(int(grid[0]), seconds, settings)
            if not torch.equal(times, times.round()):
                raise ValueError(f"the video at {start} has fractional time positions")
            video = vision_positions(self.next, times.long(), grid, merge)
            length = video.shape[1]
            if not interleaved:
                self.add(video)
            else:
                count = audio_output_length(next(media.audios), settings.audio_n_window)
                self.interleaved(video, torch.arange(count).expand(3, count) + self.next)
                length += count
        return length

    def interleaved(self, video: torch.Tensor, audio: torch.Tensor) -> None:
        """A video's and its audio track's positions merged by time (row 0); the last
        piece is the tail, the stream left over when the other ran out."""
        order = time_order(video[0].tolist(), audio[0].tolist())
        merged = torch.empty(3, len(order), dtype=torch.long)
        is_video = torch.tensor(order)
        merged[:, is_video], merged[:, ~is_video] = video, audio
        tail = len(order)  # the tail: the last run of one stream's positions
        while tail > 0 and order[tail - 1] == order[-1]:
            tail -= 1
        if tail > 0:
            self.add(merged[:, :tail])
        self.add(merged[:, tail:])


# Positions [3, n] of an expanded prompt and its delta (omni_rope.rope_index's arguments;
# ValueError also when a video's times are not whole numbers).
rope_index = functools.partial(omni_rope.rope_index, pieces=_Pieces)
