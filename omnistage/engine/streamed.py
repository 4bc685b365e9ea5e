"""A streamed edge: two stages of one request at work at once.

When a stage's config says ``stream: true``, it takes the stage before's output while it is
produced: its request is submitted when the stage before starts (``AddRequest.stream``
names the processor whose stream turns the input into the stage's: a ``TokenStream`` of
token ids, or for a stage that takes embeddings an ``EmbedStream`` of hidden-state rows),
and every output of the stage before goes on to it as ``AppendInput`` (its new token ids and
what it added to its hand-off; ``final`` with the last). A run of streamed edges runs as one
group (thinker -> talker -> code2wav, each streaming into the next); the stages' outputs
are merged into one stream, in the order they arrive.

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
import functools
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from omnistage.stage.media import OmniAudio
from omnistage.stage.messages import OutputMessage, StageRequest, Upstream

Item = tuple[int, OutputMessage, bool]  # stage id, output, whether it ends the stage's work


def _nothing() -> None:
    pass


@dataclass
class StageRun:
    """One stage's part of a request, as the router runs it: ``bound`` holds the stages the
    request has still to reach (this one leaves it once admitted); ``num_samples`` the samples
    whose ends end it; ``forward``: the stage hands its output to the next; ``upstream``: what
    the stage before handed to this one; ``stream``: its input comes while the stage before
    produces it, through this processor's stream (``stream_params``: the request's
    parameters, per field); ``on_submit`` runs once the stage took the request."""

    stage_id: int
    request_id: str
    request: StageRequest
    bound: set[int]
    num_samples: int = 1
    forward: bool = False
    upstream: Upstream | None = None
    on_submit: Callable[[], None] = field(default=_nothing)
    stream: str | None = None
    request_start: float | None = None
    stream_params: dict[str, dict[str, Any]] | None = None


RunStage = Callable[[StageRun], AsyncIterator[tuple[OutputMessage, bool]]]
SendInput = Callable[[list[int], bool, Any], None]  # token ids, final, the hand-off's delta
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
    stages: list[StageRun],
    send_inputs: list[SendInput],
    aborts: list[Callable[[], None]],
) -> AsyncIterator[Item]:
    """Run ``stages`` together, each feeding
    its outputs (token ids, and what they add to its hand-off) to the next through
    ``send_inputs[i]`` (``aborts[i]`` aborts the next one's request); yields ``(stage_id,
    output, ends_stage)`` of all as they come."""
    merged: asyncio.Queue[Item | BaseException] = asyncio.Queue()
    admitted = [asyncio.Event() for _ in stages]
    held: list[list[tuple[list[int], bool, Any]]] = [[] for _ in stages]

    def feed(i: int, token_ids: list[int], final: bool, delta: Any) -> None:
        """Input for stage ``i`` (held until it is admitted)."""
        if admitted[i].is_set():
            send_inputs[i - 1](token_ids, final, delta)
        else:
            held[i].append((token_ids, final, delta))

    def on_admitted(i: int) -> None:
        admitted[i].set()
        for args in held[i]:
            send_inputs[i - 1](*args)
        held[i].clear()

    async def pump(i: int) -> None:
        stage_id = stages[i].stage_id
        feeds = i + 1 < len(stages)
        try:
            async for out, ends in run_stage(stages[i]):
                if feeds and out.error is None:
                    last = ends and out.finish_reason in ENDED_WELL
                    delta = getattr(out, "delta", None)
                    if out.new_token_ids or last or delta is not None:
                        feed(i + 1, list(out.new_token_ids), last, delta)
                    if ends and not last:
                        aborts[i]()
                await merged.put((stage_id, out, ends))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the consumer, which raises it
            await merged.put(exc)

    last_stage = stages[-1].stage_id
    tasks = []
    for i in reversed(range(len(stages))):  # the later ones first: ready for their input
        if i:
            stages[i].on_submit = functools.partial(on_admitted, i)
        tasks.append(asyncio.create_task(pump(i)))
    try:
        while True:
            item = await merged.get()
            if isinstance(item, BaseException):
                raise item
            yield item
            stage_id, out, ends = item
            if ends and (stage_id == last_stage or out.finish_reason not in ENDED_WELL):
                return
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
