"""What the omni families' 3-D rotary positions (``qwen2_5_omni.rope_index``,
``qwen3_omni.rope_index``) share: the walk over a prompt's placeholder runs, as transformers'
``get_rope_index`` walks them for one unpadded prompt. Text counts up in all three rows, one
more than the piece before it; each run sits between its start and end token(s) (two of each
around a video with its audio track); the family places a run's own positions."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

# A run's positions, added to the pieces: (its placeholder token, where it starts, whether it
# is a video interleaved with its audio track) -> its length in tokens.
PlaceRun = Callable[[int, int, bool], int]


class Pieces:
    """Position pieces in prompt order; ``next`` is one past the last piece's maximum."""

    def __init__(self) -> None:
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


def walk_runs(
    token_ids: Sequence[int],
    settings: Any,
    use_audio_in_video: bool,
    out: Pieces,
    place: PlaceRun,
) -> tuple[torch.Tensor, int]:
    """Positions ``[3, n]`` of a prompt and its delta: text counting up, each placeholder
    run (of ``settings``' ``audio_token_id``, ``image_token_id`` or ``video_token_id``) framed
    by ``out.framing`` and placed by ``place`` (a ``StopIteration`` from it: more runs than
    inputs, a ``ValueError``)."""
    n = len(token_ids)
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
            length = place(token, start, interleaved)
        except StopIteration:
            raise ValueError(
                f"the prompt has more placeholder runs than inputs (at {start})"
            ) from None
        out.framing(framing)
        cursor = start + length + framing
    out.counting(n - cursor)
    return out.positions(n)
