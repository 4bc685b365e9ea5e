"""Qwen2.5-Omni's 3-D rotary positions (TMRoPE) of one prompt, as transformers'
``Qwen2_5OmniPreTrainedModelForConditionalGeneration.get_rope_index`` computes them for one
unpadded prompt (transformers 5.24, ``modeling_qwen2_5_omni.py`` l. 217-505).

Each position has three rows (time, height, width). Text takes the same value in all three,
one more than the piece before it. An image or video run takes its patch grid: time
``t * seconds_per_grid * position_id_per_seconds`` (an image: ``t * position_id_per_seconds``),
height and width the merged patch's row and column, all offset by where the run starts. An
audio run counts up like text, one position per encoder output (40 ms, so 25 per second). A
video with its audio track (``use_audio_in_video``) interleaves the two in chunks of
``seconds_per_chunk`` (video tokens of a chunk, then its audio tokens), each keeping the
positions it would have alone: both streams start at the same position, so time aligns them.

transformers' quirks, kept so that the positions equal its own:

- every value after a piece is the maximum of that piece (not of everything so far) plus one;
  after an interleaved run that piece is its last chunk;
- the bos and eos tokens framing a placeholder run take one position each; the two of an
  interleaved run (``<|vision_bos|><|audio_bos|>``, ``<|audio_eos|><|vision_eos|>``) share one;
- a prompt with no image and no video gets plain positions ``0 .. n - 1`` in all three rows
  even when it holds audio (transformers takes its 3-D branch only when there is a grid);
- chunks split at each value that reaches the next multiple of the chunk size, the multiple
  moving up by one per split: after a jump over several multiples the following values split
  again, one by one (``chunk_bounds``; only frame rates under one temporal patch per chunk
  jump so).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.models import omni_rope


@dataclass(frozen=True)
class PositionSettings:
    """What the positions depend on besides the prompt: its placeholder ids and the thinker
    config's time scales."""

    audio_token_id: int
    image_token_id: int
    video_token_id: int
    spatial_merge_size: int = 2
    position_id_per_seconds: int | float = 25
    seconds_per_chunk: int | float = 2

    @classmethod
    def from_config(cls, thinker: dict[str, Any]) -> PositionSettings:
        """From ``config.json``'s ``thinker_config``."""
        return cls(
            audio_token_id=int(thinker["audio_token_index"]),
            image_token_id=int(thinker["image_token_index"]),
            video_token_id=int(thinker["video_token_index"]),
            spatial_merge_size=int(
                (thinker.get("vision_config") or {}).get("spatial_merge_size", 2)
            ),
            position_id_per_seconds=thinker.get("position_id_per_seconds", 25),
            seconds_per_chunk=thinker.get("seconds_per_chunk", 2),
        )

    @property
    def tokens_per_chunk(self) -> int:
        return int(self.position_id_per_seconds * self.seconds_per_chunk)


def audio_output_length(frames: int) -> int:
    """Encoder outputs (placeholder tokens) of ``frames`` mel frames: a stride-2 convolution,
    then stride-2 pooling."""
    return ((frames - 1) // 2 + 1 - 2) // 2 + 1


def chunk_bounds(values: Sequence[float], per_chunk: float) -> list[tuple[int, int]]:
    """``(start, end)`` index ranges splitting non-decreasing ``values`` before each value that
    reaches ``k * per_chunk``, ``k`` counting up from 1 by one per split, as transformers'
    ``get_chunked_index`` (so values past a jump over several multiples split one by one)."""
    bounds, start, chunk = [], 0, 1
    for i, value in enumerate(values):
        if value >= chunk * per_chunk:
            bounds.append((start, i))
            start, chunk = i, chunk + 1
    bounds.append((start, len(values)))
    return bounds


def interleaved_layout(
    grid: Sequence[int], seconds_per_grid: float, audio_tokens: int, settings: PositionSettings
) -> list[bool]:
    """Which tokens of a video-with-audio run are video ones, as ``Qwen2_5OmniProcessor``
    lays the run out: per chunk, the chunk's video tokens, then its audio tokens. Its chunks
    come from its own times (float64, not truncated: a temporal patch at ``t *
    seconds_per_grid * position_id_per_seconds``, an audio token at its index), which may
    split differently from the positions' (``rope_index``), as in transformers."""
    merge = settings.spatial_merge_size
    per_frame = (grid[1] // merge) * (grid[2] // merge)
    times = [t * seconds_per_grid * settings.position_id_per_seconds for t in range(grid[0])]
    per = settings.tokens_per_chunk
    video = chunk_bounds([time for time in times for _ in range(per_frame)], per)
    audio = chunk_bounds(list(range(audio_tokens)), per)
    layout: list[bool] = []
    for j in range(max(len(video), len(audio))):
        if j < len(video):
            layout += [True] * (video[j][1] - video[j][0])
        if j < len(audio):
            layout += [False] * (audio[j][1] - audio[j][0])
    return layout


def vision_positions(
    start: int, time: torch.Tensor, grid_h: int, grid_w: int, merge: int
) -> torch.Tensor:
    """``[3, T * H * W]`` positions of a merged patch grid (time-major, then rows, then
    columns) whose time values are ``time`` [T], all offset by ``start``."""
    h, w = grid_h // merge, grid_w // merge
    t_rows = time.view(-1, 1).expand(-1, h * w).flatten()
    h_rows = torch.arange(h).view(1, -1, 1).expand(len(time), -1, w).flatten()
    w_rows = torch.arange(w).view(1, 1, -1).expand(len(time), h, -1).flatten()
    return torch.stack([t_rows, h_rows, w_rows]) + start


def video_times(grid_t: int, seconds_per_grid: float, settings: PositionSettings) -> torch.Tensor:
    """Time positions of a video's temporal patches, in transformers' float32 arithmetic."""
    seconds = torch.tensor(seconds_per_grid, dtype=torch.float32)
    return (torch.arange(grid_t) * seconds * settings.position_id_per_seconds).long()


class _Pieces(omni_rope.Pieces):
    settings: PositionSettings

    def framing(self, count: int) -> None:
        """The start (or end) tokens around a run: one position for both of an interleaved
        run's two bos or eos tokens."""
        self.counting(1, times=count)

    def place(self, token: int, start: int, interleaved: bool) -> int:
        settings, media = self.settings, self.media
        merge = settings.spatial_merge_size
        if token == settings.audio_token_id:
            length = audio_output_length(next(media.audios))
            self.counting(length)
        elif token == settings.image_token_id:
            t, h, w = (int(v) for v in next(media.images))
            time = torch.arange(t) * 1 * settings.position_id_per_seconds
            self.add(vision_positions(self.next, time.long(), h, w, merge))
            length = t * h * w // merge**2
        else:
            (t, h, w), seconds = next(media.videos)
            time = video_times(int(t), seconds, settings)
            video = vision_positions(self.next, time, int(h), int(w), merge)
            length = video.shape[1]
            if not interleaved:
                self.add(video)
            else:
                audio_len = audio_output_length(next(media.audios))
                audio = torch.arange(audio_len).expand(3, audio_len) + self.next
                per = settings.tokens_per_chunk
                v_chunks = chunk_bounds((video[0] - self.next).tolist(), per)
                a_chunks = chunk_bounds((audio[0] - self.next).tolist(), per)
                for j in range(max(len(v_chunks), len(a_chunks))):
                    if j < len(v_chunks):
                        self.add(video[:, v_chunks[j][0] : v_chunks[j][1]])
                    if j < len(a_chunks):
                        self.add(audio[:, a_chunks[j][0] : a_chunks[j][1]])
                length += audio_len
        return length


# Positions [3, n] of an expanded prompt and its delta (omni_rope.rope_index's arguments).
rope_index = functools.partial(omni_rope.rope_index, pieces=_Pieces)
