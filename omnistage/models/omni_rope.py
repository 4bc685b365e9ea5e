"""What the omni families' 3-D rotary positions (``qwen2_5_omni.rope_index``,
``qwen3_omni.rope_index``) share: the walk over a prompt's placeholder runs, as transformers'
``get_rope_index`` walks them for one unpadded prompt. Text counts up in all three rows, one
more than the piece before it; each run sits between its start and end token(s) (two of each
around a video with its audio track); the family places a run's own positions (its
``Pieces``)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Media:
    """A prompt's media, in prompt order, taken one per placeholder run: image grids,
    video grids with their seconds per temporal patch, audio mel frame counts."""

    images: Iterator[Sequence[int]]
    videos: Iterator[tuple[Sequence[int], float]]
    audios: Iterator[int]


class Pieces:
    """Position pieces in prompt order; ``next`` is one past the last piece's maximum. A
    family's places each placeholder run (``place``), taking its inputs from ``media``."""

    def __init__(self, settings: Any, media: Media) -> None:
        self.settings = settings
        self.media = media
        self.pieces: list[torch.Tensor] = []
        self.next = 0

    def add(self, piece: torch.Tensor, times: int = 1) -> None:
        self.pieces.extend([piece] * times)
        self.next = int(piece.max()) + 1

    def counting(self, count: int, times: int = 1) -> None:
        """``count`` positions counting up from ``next`` in all three rows (``times`` copies
        of them)."""
        if count > 0:
            self.add(torch.arange(count).expand(3, count) + self.next, times)

    def framing(self, count: int) -> None:
        """The ``count`` start (or end) tokens around a run: one position each."""
        self.counting(count)

    def place(self, token: int, start: int, interleaved: bool) -> int:
        """Add the positions of the run of placeholder ``token`` at ``start`` (``interleaved``:
        a video with its audio track); returns its length in tokens."""
        raise NotImplementedError

    def positions(self, n: int) -> tuple[torch.Tensor, int]:
        """The pieces as positions ``[3, n]`` and their delta (``ValueError`` when they are
        not ``n`` long)."""
        positions = (
            torch.cat(self.pieces, dim=1) if self.pieces else torch.zeros(3, 0, dtype=torch.long)
        )
        if positions.shape[1] != n:
            raise ValueError(
                f"the placeholder runs do not fit the prompt ({positions.shape[1]} != {n})"
            )
        return positions, int(positions.max()) + 1 - n if n else 0


def rope_index(
    token_ids: Sequence[int],
    settings: Any,
    *,
    pieces: Callable[[Any, Media], Pieces],
    image_grid_thw: Sequence[Sequence[int]] = (),
    video_grid_thw: Sequence[Sequence[int]] = (),
    video_seconds_per_grid: Sequence[float] = (),
    audio_frames: Sequence[int] = (),
    use_audio_in_video: bool = False,
) -> tuple[torch.Tensor, int]:
    """Positions ``[3, n]`` (long) of an expanded prompt and its delta (``max + 1 - n``: a
    generated token's position is its index plus the delta), its runs placed by the family's
    ``pieces``.

    Grids, seconds per temporal patch and audio mel frame counts come in prompt order; with
    ``use_audio_in_video`` every video's audio is the next audio in ``audio_frames``, at the
    video's place. Each placeholder run (of ``settings``' ``audio_token_id``,
    ``image_token_id`` or ``video_token_id``) must sit between its start and end token(s), as
    the chat template puts it (``ValueError`` when the runs do not fit the prompt)."""
    n = len(token_ids)
    if not image_grid_thw and not video_grid_thw:  # transformers' 1-D branch, audio or not
        return torch.arange(n).expand(3, n).clone(), 0
    videos = zip(video_grid_thw, video_seconds_per_grid, strict=True)
    out = pieces(settings, Media(iter(image_grid_thw), iter(videos), iter(audio_frames)))
    placeholders = {settings.audio_token_id, settings.image_token_id, settings.video_token_id}
    cursor = 0
    while True:
        start = next((i for i in range(cursor, n) if token_ids[i] in placeholders), None)
        if start is None:
            break
        token = token_ids[start]
        interleaved = use_audio_in_video and token == settings.video_token_id
        framing = 2 if interleaved else 1  # start (and end) tokens around the run
        out.counting(start - cursor - framing)  # the text before the run's start token(s)
        out.framing(framing)
        try:
            length = out.place(token, start, interleaved)
        except StopIteration:
            raise ValueError(
                f"the prompt has more placeholder runs than inputs (at {start})"
            ) from None
        out.framing(framing)
        cursor = start + length + framing
    out.counting(n - cursor)
    return out.positions(n)
