"""A streamed edge: two stages of one request at work at once.

When a stage's config says ``stream: true``, it takes the stage before's output while it is
produced: its request is submitted when the stage before starts (``AddRequest.stream``
names the processor whose ``TokenStream`` filters the input in the stage), and every output
of the stage before goes on to it as ``AppendInput`` (its new token ids; ``final`` with the
last). Both stages' outputs are merged into one stream, in the order they arrive.

Ending: the request ends with the later stage's last output. The earlier stage ending with
an abort ends the request as aborted (the later stage's request is aborted with it); an
error in either raises. A caller that goes away cancels both, and each stage's request is
aborted on the way out (``RequestRouter._run_stage``'s ``finally``), so neither does more
work for it. Input produced while the later stage still waits for admission (paused) is held
here and sent when it is admitted.

Media pieces: a later stage that speaks chunk by chunk sends each chunk's samples in an
unfinished output; ``AudioJoin`` keeps them so the last output can carry the whole waveform
(``media``) beside its last piece (``media_delta``), as a whole hand-off would have.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import numpy as np

from omnistage.stage.media import OmniAudio
from omnistage.stage.messages import OutputMessage

Item = tuple[int, OutputMessage, bool]  # stage id, output, whether it ends the stage's work
RunStage = Callable[..., AsyncIterator[tuple[OutputMessage, bool]]]
ENDED_WELL = ("stop", "length")


class AudioJoin:
    """The audio pieces of one streamed request, joined into the whole at its end."""

    def __init__(self) -> None:
        self.pieces: list[np.ndarray] = []

    def add(self, media: list[Any]) -> list[Any]:
        """``media`` as the client sees it; audio pieces are kept for the whole."""
        shown = [m.to_client() for m in media]
        self.pieces.extend(m.samples for m in shown if isinstance(m, OmniAudio))
        return shown

    def whole(self, last: list[Any]) -> list[Any]:
        """The last output's media with each waveform replaced by the whole utterance."""
        out = []
        for item in last:
            if isinstance(item, OmniAudio):
                samples = np.concatenate(self.pieces) if self.pieces else item.samples
                item = OmniAudio(samples, item.sample_rate, item.voice, item.seed, item.codes)
            out.append(item)
        return out


async def run_streamed(
    run_stage: RunStage,
    send_input: Callable[[list[int], bool], None],
    abort_later: Callable[[], None],
    earlier: tuple[int, dict[str, Any]],
    later: tuple[int, dict[str, Any]],
) -> AsyncIterator[Item]:
    """Run ``earlier`` and ``later`` (``(stage_id, run_stage keyword arguments)``) together,
    feeding the earlier one's token ids to the later one through ``send_input``; yields
    ``(stage_id, output, ends_stage)`` of both as they come."""
    merged: asyncio.Queue[Item | BaseException] = asyncio.Queue()
    admitted = asyncio.Event()
    held: list[tuple[list[int], bool]] = []

    def feed(token_ids: list[int], final: bool) -> None:
        if admitted.is_set():
            send_input(token_ids, final)
        else:
            held.append((token_ids, final))

    def on_admitted() -> None:
        admitted.set()
        for token_ids, final in held:
            send_input(token_ids, final)
        held.clear()

    async def pump(stage_id: int, kwargs: dict[str, Any], is_earlier: bool) -> None:
        try:
            async for out, ends in run_stage(**kwargs):
                if is_earlier and out.error is None:
                    last = ends and out.finish_reason in ENDED_WELL
                    if out.new_token_ids or last:
                        feed(list(out.new_token_ids), last)
                    if ends and not last:
                        abort_later()
                await merged.put((stage_id, out, ends))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which raises it
            await merged.put(exc)

    later_kwargs = {**later[1], "on_submit": on_admitted}
    tasks = [
        asyncio.create_task(pump(later[0], later_kwargs, False)),
        asyncio.create_task(pump(earlier[0], earlier[1], True)),
    ]
    try:
        while True:
            item = await merged.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            stage_id, out, ends = item
            if ends and (stage_id == later[0] or out.finish_reason not in ENDED_WELL):
                return
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
