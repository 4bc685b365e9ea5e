"""The code2wav stage engine: speech-codec tokens in, a waveform out, step by step.

Scheduling, control and weights are the step-scheduled engine's (``omnistage.stage.jobs``):
the same pause modes, sleep levels, wake with reload, weight updates and syncs as a diffusion
stage. A job here is one request (``omnistage.stage.code2wav.job``), synthesised by the
vocoder of the checkpoint's model family: up to ``max_num_seqs`` utterances are decoded at
once, taking turns one synthesis step each per engine step, so a long utterance never holds a
short one behind it; each one's audio is bit-identical to what it would be alone. A request
without a seed draws one, reported in its ``AudioOutput``.
"""

from __future__ import annotations

import secrets
import time
from typing import Any

from omnistage.config import StageConfig
from omnistage.errors import InvalidRequestError
from omnistage.stage.code2wav.job import Code2WavJob, StreamingCode2WavJob
from omnistage.stage.code2wav.params import Code2WavLimits
from omnistage.stage.code2wav.request import Code2WavRequest, check_codes, validate_request
from omnistage.stage.code2wav.wire import KIND, Code2WavStageInfo, Code2WavStageRequest
from omnistage.stage.code2wav.worker import Code2WavWorker
from omnistage.stage.jobs import JobEngine, StepJob

MAX_SEED = 2**63 - 1  # drawn seeds


class Code2WavStageEngine(JobEngine[Code2WavWorker, Code2WavRequest]):
    """Serves the vocoder part of a checkpoint folder (``config.model``)."""

    def __init__(self, config: StageConfig, *, load_weights: bool = True) -> None:
        if config.kind != KIND:
            raise ValueError(f"Code2WavStageEngine needs kind {KIND!r}, got {config.kind!r}")
        super().__init__(config, Code2WavWorker(config, load_weights=load_weights))
        self.limits: Code2WavLimits = self.worker.limits

    @property
    def vocoder(self) -> Any:
        return self.worker.vocoder

    @property
    def max_active_jobs(self) -> int:
        return self.config.code2wav.max_num_seqs

    def info(self) -> Code2WavStageInfo:
        """What the API process needs to validate requests before they reach this stage."""
        return Code2WavStageInfo(limits=self.limits)

    def add_wire_request(self, request_id: str, request: object) -> None:
        """``add_request`` for a request that came over the wire (``Code2WavStageRequest``)."""
        if not isinstance(request, Code2WavStageRequest):
            raise InvalidRequestError(
                "request",
                f"a code2wav stage takes 'code2wav' requests, got {type(request).__name__}",
            )
        self.add_request(Code2WavRequest(request_id, codes=request.codes, params=request.params))

    def add_streamed_request(self, request_id: str, request: object) -> None:
        """A request whose codes arrive later (``append_input``), spoken chunk by chunk as
        the stage config's ``stream_chunks`` say (its ``params.first_chunk``, if set, sends
        an early first chunk: ``Code2WavStream``)."""
        if not isinstance(request, Code2WavStageRequest):
            raise InvalidRequestError(
                "request",
                f"a code2wav stage takes 'code2wav' requests, got {type(request).__name__}",
            )
        self.add_request(
            Code2WavRequest(
                request_id,
                codes=list(request.codes),
                params=request.params,
                streamed=True,
                input_ended=False,
            )
        )

    def _append(self, request_id: str, token_ids: list[int], final: bool) -> bool:
        for request in self._waiting:
            if request.request_id == request_id and request.streamed:
                if token_ids:
                    check_codes(token_ids, self.limits, before=len(request.codes))
                request.codes.extend(token_ids)
                request.input_ended = final
                return True
        for job in self._jobs:
            if isinstance(job, StreamingCode2WavJob) and request_id in job.request_ids:
                if token_ids:
                    check_codes(token_ids, self.limits, before=len(job.request.codes))
                job.add_input(token_ids, final)
                return True
        return False

    def _companions(self, job: StepJob, runnable: list[StepJob]) -> list[StepJob]:
        """Utterances whose next step has the same shape share its DiT forwards (each still
        gets the samples it gets alone: ``advance_together``)."""
        key = getattr(job, "batch_key", None)
        if key is None:
            return []
        same = [j for j in runnable if j is not job and getattr(j, "batch_key", None) == key]
        return same[: self.config.code2wav.max_num_seqs - 1]

    def _advance_together(self, jobs: list[StepJob]) -> None:
        started = time.perf_counter()
        self.vocoder.advance_together([job.target for job in jobs])  # type: ignore[attr-defined]
        share = (time.perf_counter() - started) / len(jobs)
        for job in jobs:
            job.compute_s += share  # type: ignore[attr-defined]

    def _check_request(self, request: Code2WavRequest) -> None:
        validate_request(request, self.limits)
        early = request.streamed and request.params.first_chunk is not None
        if early and not getattr(self.vocoder, "early_first_chunk", False):
            raise InvalidRequestError(
                "audio_params.first_chunk",
                "this model's stream sends no early first chunk (its chunks are the stage's "
                "stream_chunks)",
            )

    def _make_job(self, requests: list[Code2WavRequest]) -> StepJob:
        (request,) = requests
        seed = request.params.seed
        if seed is None:
            seed = secrets.randbelow(MAX_SEED)
        if request.streamed:
            return StreamingCode2WavJob(self.vocoder, request, seed, self.config.stream_chunks)
        return Code2WavJob(self.vocoder, request, seed)

    def _status_fields(self) -> dict[str, Any]:
        return {
            "num_requests_started": self.num_jobs,
            "num_synthesis_steps": self.num_steps,
            "num_batched_steps": self.num_batched_steps,
            "weight_bytes": self.vocoder.weight_bytes,
            "voices": list(self.limits.voices),
            "default_voice": self.limits.default_voice,
            "sample_rate": self.limits.sample_rate,
        }
