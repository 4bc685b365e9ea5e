"""Per-stage timings of each request, measured in the API process as outputs arrive.

``StageTimer`` follows one request through one stage: from its admission (submit) to its
first token (time to first token, AR stages), between tokens (inter-token latency), to the
end of each sample (end-to-end latency), plus the stage's own report of how long the request
waited to be scheduled (queue time); for a stage that speaks, the time from the request's
start (its arrival in the pipeline) to its first audio, the seconds of audio made and the
stage's compute time for them. When a sample finishes, listeners receive a
``StageRequestStats`` (the metrics subscribe; nothing is kept).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from omnistage.stage.kinds import stage_kind
from omnistage.stage.messages import OutputMessage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageRequestStats:
    """One finished sample of one request at one stage (times in seconds)."""

    request_id: str
    stage_id: int
    kind: str
    index: int
    finish_reason: str | None
    e2e_s: float
    ttft_s: float | None  # AR stages: submit to first token
    inter_token_s: tuple[float, ...]  # AR stages: between consecutive token outputs
    queue_s: float | None  # the stage's wait before scheduling, as the stage measured it
    num_prompt_tokens: int
    num_output_tokens: int
    streams_tokens: bool = True  # a token stage (TTFT, inter-token latency, token counts)
    first_audio_s: float | None = None  # request start to its first audio from this stage
    audio_s: float = 0.0  # seconds of audio this stage made for the request
    audio_compute_s: float = 0.0  # the stage's compute time for that audio


StatsListener = Callable[[StageRequestStats], None]


@dataclass
class _Sample:
    first_token: float | None = None
    last_token: float | None = None
    inter_token: list[float] = field(default_factory=list)
    first_audio: float | None = None
    audio_s: float = 0.0
    audio_compute_s: float = 0.0


class StageTimer:
    def __init__(
        self,
        request_id: str,
        stage_id: int,
        kind: str,
        listeners: list[StatsListener],
        request_start: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.stage_id = stage_id
        self.kind = kind
        self.listeners = listeners
        self.start = time.monotonic()
        self.request_start = self.start if request_start is None else request_start
        self.queue_s: float | None = None
        self.samples: dict[int, _Sample] = {}

    def observe(self, out: OutputMessage) -> None:
        if not self.listeners:
            return
        now = time.monotonic()
        if out.queue_time_s is not None and self.queue_s is None:
            self.queue_s = out.queue_time_s
        sample = self.samples.setdefault(out.index, _Sample())
        if out.new_token_ids:
            if sample.last_token is None:
                sample.first_token = now
            else:
                sample.inter_token.append(now - sample.last_token)
            sample.last_token = now
        for media in out.media:  # a waveform (samples at a rate) is audio
            rate = getattr(media, "sample_rate", 0)
            if rate and media.samples.numel():
                sample.first_audio = sample.first_audio or now
                sample.audio_s += media.samples.numel() / rate
                sample.audio_compute_s += float(getattr(media, "compute_s", 0.0))
        if out.finished:
            self._emit(out, sample, now)

    def _emit(self, out: OutputMessage, sample: _Sample, now: float) -> None:
        stats = StageRequestStats(
            request_id=self.request_id,
            stage_id=self.stage_id,
            kind=self.kind,
            index=out.index,
            finish_reason=out.finish_reason,
            e2e_s=now - self.start,
            ttft_s=None if sample.first_token is None else sample.first_token - self.start,
            inter_token_s=tuple(sample.inter_token),
            queue_s=self.queue_s,
            num_prompt_tokens=out.num_prompt_tokens,
            num_output_tokens=out.num_output_tokens,
            streams_tokens=stage_kind(self.kind).output_type is None,
            first_audio_s=(
                None if sample.first_audio is None else sample.first_audio - self.request_start
            ),
            audio_s=sample.audio_s,
            audio_compute_s=sample.audio_compute_s,
        )
        for listener in self.listeners:
            try:
                listener(stats)
            except Exception:  # a broken listener must not fail the request
                logger.exception("request stats listener failed")
