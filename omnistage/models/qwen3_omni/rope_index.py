"""Qwen3-Omni's 3-D rotary positions of one prompt, as transformers'
``Qwen3OmniMoePreTrainedModelForConditionalGeneration.get_rope_index`` computes them for one
unpadded prompt of text, audio and pictures (transformers 5.24, ``modeling_qwen3_omni_moe.py``
l. 220-464; the decoder turns them by interleaved sections, ``RopeConfig.mrope_interleaved``).

Each position has three rows (time, height, width). Text takes the same value in all three,
one more than the piece before it. A picture's run takes its merged patch grid: time
``t * position_id_per_seconds``, height and width the merged patch's row and column, all
offset by where the run starts. An audio run counts up like text, one position per encoder
output. The start and end tokens framing a run take one position each.

transformers' quirks, kept so that the positions equal its own:

- every value after a piece is the maximum of that piece (not of everything so far) plus one;
- a prompt with no picture (and no video) gets plain positions ``0 .. n - 1`` in all three
  rows even when it holds audio (transformers takes its 3-D branch only when there is a grid);
- transformers computes them in float32: a picture's time ``t * position_id_per_seconds`` is
  a whole number for the checkpoints' whole ``position_id_per_seconds``, so the positions are
  integers (a fractional rate is refused where the processor is built).

Videos (whose times ``t * seconds_per_grid * position_id_per_seconds`` are fractional in
general) are not served.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from omnistage.models.qwen3_omni.encoders import audio_output_length


@dataclass(frozen=True)
class PositionSettings:
    """What the positions depend on besides the prompt: its placeholder ids, the merge size
    of the vision encoder, the time scale and the audio encoder's chunking."""

    audio_token_id: int
    image_token_id: int
    spatial_merge_size: int = 2
    position_id_per_seconds: int = 13
    audio_n_window: int = 50


def vision_positions(start: int, grid: Sequence[int], settings: PositionSettings) -> torch.Tensor:
    """``[3, t * h * w / merge^2]`` positions of a picture's merged patch grid (time-major,
    then rows, then columns), offset by ``start``."""
    t, h, w = (int(v) for v in grid)
    merge = settings.spatial_merge_size
    h, w = h // merge, w // merge
    time = torch.arange(t) * settings.position_id_per_seconds
    t_rows = time.view(-1, 1).expand(-1, h * w).flatten()
    h_rows = torch.arange(h).view(1, -1, 1).expand(t, -1, w).flatten()
    w_rows = torch.arange(w).view(1, 1, -1).expand(t, h, -1).flatten()
    return torch.stack([t_rows, h_rows, w_rows]) + start


class _Pieces:
    """Position pieces in prompt order; ``next`` is one past the last piece's maximum."""

    def __init__(self) -> None:
        self.pieces: list[torch.Tensor] = []
        self.next = 0

    def add(self, piece: torch.Tensor) -> None:
        self.pieces.append(piece)
        self.next = int(piece.max()) + 1

    def counting(self, count: int) -> None:
        """``count`` positions counting up from ``next`` in all three rows."""
        if count > 0:
            self.add(torch.arange(count).expand(3, count) + self.next)


def rope_index(
    token_ids: Sequence[int],
    settings: PositionSettings,
    *,
    image_grid_thw: Sequence[Sequence[int]] = (),
    audio_frames: Sequence[int] = (),
) -> tuple[torch.Tensor, int]:
    """Positions ``[3, n]`` (long) of an expanded prompt and its delta (``max + 1 - n``: a
    generated token's position is its index plus the delta).

    Grids and audio mel frame counts come in prompt order. Each placeholder run must sit
    between its start and end token, as the chat template puts it (``ValueError`` when the
    runs do not fit the prompt)."""
    n = len(token_ids)
    if not image_grid_thw:  # transformers' 1-D branch, audio or not
        return torch.arange(n).expand(3, n).clone(), 0
    images, audios = iter(image_grid_thw), iter(audio_frames)
    placeholders = {settings.audio_token_id, settings.image_token_id}
    merge = settings.spatial_merge_size
    out = _Pieces()
    cursor = 0
    while True:
        start = next((i for i in range(cursor, n) if token_ids[i] in placeholders), None)
        if start is None:
            break
        out.counting(start - cursor - 1)  # the text before the run's start token
        out.counting(1)
        try:
            if token_ids[start] == settings.audio_token_id:
                length = audio_output_length(next(audios), settings.audio_n_window)
                out.counting(length)
            else:
                grid = next(images)
                out.add(vision_positions(out.next, grid, settings))
                length = int(grid[0]) * int(grid[1]) * int(grid[2]) // merge**2
        except StopIteration:
            raise ValueError(
                f"the prompt has more placeholder runs than inputs (at {start})"
            ) from None
        out.counting(1)
        cursor = start + length + 1
    out.counting(n - cursor)
    positions = torch.cat(out.pieces, dim=1) if out.pieces else torch.zeros(3, 0, dtype=torch.long)
    if positions.shape[1] != n:
        raise ValueError(
            f"the placeholder runs do not fit the prompt ({positions.shape[1]} != {n})"
        )
    return positions, int(positions.max()) + 1 - n if n else 0
