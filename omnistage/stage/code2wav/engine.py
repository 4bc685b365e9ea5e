"""The code2wav stage engine: speech-codec tokens in, a waveform out, step by step.

Scheduling, control and weights are the step-scheduled engine's (``omnistage.stage.jobs``):
the same pause modes, sleep levels, wake with reload, weight updates and syncs as a diffusion
stage. A job here is one request (``omnistage.stage.code2wav.flow``): up to ``max_num_seqs``
utterances are decoded at once, taking turns one RK4 step each per engine step, so a long
utterance never holds a short one behind it; each one's audio is bit-identical to what it
would be alone. A request without a seed draws one, reported in its ``AudioOutput``.
"""

from __future__ import annotations

import secrets
from typing import Any

from omnistage.config import StageConfig
from omnistage.errors import InvalidRequestError
from omnistage.stage.code2wav.flow import Code2WavJob
from omnistage.stage.code2wav.params import Code2WavLimits
from omnistage.stage.code2wav.pipeline import Token2WavPipeline
from omnistage.stage.code2wav.request import Code2WavRequest, validate_request
from omnistage.stage.code2wav.worker import Code2WavWorker
from omnistage.stage.jobs import JobEngine, StepJob
from omnistage.stage.messages import Code2WavStageInfo, Code2WavStageRequest

MAX_SEED = 2**63 - 1  # drawn seeds


class Code2WavStageEngine(JobEngine[Code2WavRequest]):
    """Serves the token2wav part of a Qwen2.5-Omni checkpoint folder (``config.model``)."""

    payload_key = "audio"

    def __init__(self, config: StageConfig, *, load_weights: bool = True) -> None:
        if config.kind != "code2wav":
            raise ValueError(f"Code2WavStageEngine needs kind 'code2wav', got {config.kind!r}")
        self.worker: Code2WavWorker = Code2WavWorker(config, load_weights=load_weights)
        super().__init__(config, self.worker)
        self.limits: Code2WavLimits = self.pipeline.limits

    @property
    def pipeline(self) -> Token2WavPipeline:
        return self.worker.pipeline

    @property
    def max_active_jobs(self) -> int:
        return self.config.max_num_seqs

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

    def _check_request(self, request: Code2WavRequest) -> None:
        validate_request(request, self.limits)

    def _make_job(self, requests: list[Code2WavRequest]) -> StepJob:
        (request,) = requests
        seed = request.params.seed
        return Code2WavJob(
            self.pipeline, request, seed if seed is not None else secrets.randbelow(MAX_SEED)
        )

    def _status_fields(self) -> dict[str, Any]:
        return {
            "num_requests_started": self.num_jobs,
            "num_ode_steps": self.num_steps,
            "weight_bytes": self.pipeline.weight_bytes,
            "voices": list(self.limits.voices),
            "default_voice": self.limits.default_voice,
            "sample_rate": self.limits.sample_rate,
        }
