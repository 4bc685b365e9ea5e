"""The data path: route one request through the chain of stages it needs.

The first stage's request is prepared here, in the API process (tokenized and validated by
its kind's preparer, on a worker thread so a large prompt never stalls the event loop); stage
0 streams; each stage's final output becomes the next stage's input through the input
processor the pipeline config names, validated by the next stage's preparer. Admission per
stage goes through the shared ``AdmissionGate``; requests already in the pipeline are
*bound* for their later stages, so a sleep of one of those treats them by its mode when they
arrive.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from omnistage.config import PipelineConfig, StageConfig
from omnistage.engine import admission as adm
from omnistage.engine.input_processors import ProcessorContext, StageResult, get_input_processor
from omnistage.engine.outputs import OmniAudio, OmniImage, OmniRequestOutput
from omnistage.engine.request_stats import StageTimer, StatsListener
from omnistage.engine.stage_client import EngineStageClient
from omnistage.errors import InvalidRequestError, StageAsleepError
from omnistage.stage.kinds import stage_kind
from omnistage.stage.messages import OutputMessage, StageRequest
from omnistage.stage.prepare import RequestOptions, RequestPreparer, Wants, prompt_fields


class RequestRouter:
    """``prepare(chain)`` runs before admission (auto-wake)."""

    def __init__(
        self,
        config: PipelineConfig,
        clients: Sequence[EngineStageClient],
        gate: adm.AdmissionGate,
        prepare: Callable[[list[int]], Awaitable[None]],
    ) -> None:
        self.config = config
        self.clients = clients
        self.gate = gate
        self._prepare = prepare
        self.active: dict[str, int] = {}  # request id -> stage currently serving it
        self._downstream = self._compute_downstream()
        self._preparers: dict[int, tuple[Any, RequestPreparer]] = {}
        self.stats_listeners: list[StatsListener] = []  # per-stage request timings

    def _compute_downstream(self) -> dict[int, int]:
        downstream: dict[int, int] = {}
        for stage in self.config.stages:
            if stage.input_from is not None:
                if stage.input_from in downstream:
                    raise ValueError(
                        f"stage {stage.input_from} feeds more than one stage; only chains are supported"
                    )
                downstream[stage.input_from] = stage.stage_id
        return downstream

    def _modality(self, stage_id: int) -> str:
        """What the stage outputs: its kind's modality, unless its model says otherwise (an
        AR stage whose tokens are codes — a talker — outputs "codes", never shown)."""
        info = self.clients[stage_id].info
        if info is not None and not getattr(info, "emits_text", True):
            return "codes"
        return stage_kind(self.config.stages[stage_id].kind).modality

    def preparer(self, stage_id: int) -> RequestPreparer:
        """The stage kind's request preparer, built on the stage's latest ``StageInfo``."""
        info = self.clients[stage_id].info
        cached = self._preparers.get(stage_id)
        if cached is None or cached[0] is not info:
            stage = self.config.stages[stage_id]
            cached = (info, stage_kind(stage.kind).preparer_class()(stage, info))
            self._preparers[stage_id] = cached
        return cached[1]

    # -- data path ----------------------------------------------------------------------

    def output_modalities(self) -> list[str]:
        modalities = (self._modality(s.stage_id) for s in self.config.stages)
        return list(dict.fromkeys(m for m in modalities if m != "codes"))

    def plan(self, modalities: Sequence[str] | None) -> list[int]:
        """The chain of stages a request with these output modalities must pass through."""
        wanted = list(modalities) if modalities else self.output_modalities()
        available = self.output_modalities()
        unknown = [m for m in wanted if m not in available]
        if unknown:
            raise InvalidRequestError(
                "modalities", f"{unknown} not produced by this pipeline; it produces {available}"
            )
        last = max(s.stage_id for s in self.config.stages if self._modality(s.stage_id) in wanted)
        chain = [last]
        while self.config.stages[chain[0]].input_from is not None:
            chain.insert(0, self.config.stages[chain[0]].input_from)  # type: ignore[arg-type]
        return chain

    def _context(self, stage_id: int, options: RequestOptions) -> ProcessorContext:
        return ProcessorContext(self.config.stages[stage_id], options)

    def _wants(self, stage_id: int, chain: list[int], options: RequestOptions) -> Wants:
        """What the next stage of ``chain`` needs from ``stage_id``."""
        next_stage = self._downstream.get(stage_id)
        if next_stage is None or next_stage not in chain:
            return Wants()
        processor = get_input_processor(self.config.stages[next_stage].input_processor or "")
        return processor.wants(self._context(next_stage, options))

    def _prepare_request(
        self, stage_id: int, prompt: dict[str, Any], options: RequestOptions, chain: list[int]
    ) -> StageRequest:
        wants = self._wants(stage_id, chain, options)
        return self.preparer(stage_id).prepare(prompt, options, wants)

    async def generate(
        self,
        prompt: str | dict[str, Any],
        options: RequestOptions,
        modalities: Sequence[str] | None = None,
        *,
        request_id: str | None = None,
    ) -> AsyncIterator[OmniRequestOutput]:
        """Stream a request through the pipeline.

        ``prompt`` is a string or a dict with ``prompt``, ``prompt_token_ids`` or ``messages``
        (or ``prompt_embeds`` for a diffusion-only pipeline). Raises ``InvalidRequestError``
        before any stage is touched if the request does not fit, ``StageAsleepError`` at
        once if a needed stage is asleep; waits while one is paused.
        """
        request_id = request_id or uuid.uuid4().hex
        wanted = list(modalities) if modalities else self.output_modalities()
        chain = self.plan(wanted)
        fields = prompt_fields(prompt)
        num_samples = options.sampling_params.get("n", 1)
        if num_samples != 1 and len(chain) > 1:
            raise InvalidRequestError(
                "n", "several samples are served for requests one stage answers (text only)"
            )
        await self._prepare(chain)
        self.gate.check_available(chain)
        for stage_id in chain[1:]:  # every parameter is checked before any stage runs
            self.preparer(stage_id).check_options(options)
        request = await asyncio.to_thread(self._prepare_request, chain[0], fields, options, chain)
        # Later stages learn that this request is on its way, so a sleep of one of them can
        # treat it by the sleep's mode when it gets there (see admission.py).
        bound = set(chain[1:])
        self.gate.add_bound(bound)
        try:
            for position, stage_id in enumerate(chain):
                stage = self.config.stages[stage_id]
                emit = self._modality(stage_id) in wanted
                is_last = position == len(chain) - 1
                result = StageResult()
                samples = num_samples if position == 0 else 1
                try:
                    stream = self._run_stage(stage_id, request_id, request, bound, samples)
                    async for out, is_last_sample in stream:
                        if out.error is not None:
                            raise out.error.rebuild(stage_id)
                        result.text += out.text_delta
                        result.token_ids.extend(out.new_token_ids)
                        ends_request = is_last_sample and (is_last or out.finish_reason == "abort")
                        if emit or ends_request:
                            yield self._to_omni_output(request_id, stage, out, final=ends_request)
                        if is_last_sample:
                            result.hidden_states = out.hidden_states
                            result.token_embeddings = out.token_embeddings
                            result.num_prompt_tokens = out.num_prompt_tokens
                            if out.finish_reason == "abort":
                                return
                except StageAsleepError:
                    # Reaching a stage that an "abort" sleep took down while this request was
                    # upstream: the request was in flight, so it ends as aborted.
                    if position == 0 or self.gate.stages[stage_id].sleep_mode != "abort":
                        raise
                    yield OmniRequestOutput(
                        request_id,
                        stage_id,
                        self._modality(stage_id),
                        finished=True,
                        final=True,
                        finish_reason="abort",
                    )
                    return
                if not is_last:
                    next_id = chain[position + 1]
                    processor = get_input_processor(
                        self.config.stages[next_id].input_processor or ""
                    )
                    fields = processor.convert(result, self._context(next_id, options))
                    request = self._prepare_request(next_id, fields, options, chain)
        finally:
            self.gate.release_bound(bound)

    async def _run_stage(
        self,
        stage_id: int,
        request_id: str,
        request: StageRequest,
        bound: set[int],
        num_samples: int = 1,
    ) -> AsyncIterator[tuple[OutputMessage, bool]]:
        """Submit to one stage and stream its outputs, each with whether it ends the last of
        its ``num_samples`` samples; ``bound`` holds the stages this request has still to
        reach (this one leaves it once admitted)."""
        client = self.clients[stage_id]
        queue: asyncio.Queue[OutputMessage] | None = None
        finished = False
        unfinished = num_samples
        try:
            # The request counts as submitted inside the ``try``: a caller cancelled while
            # admission closes behind it still aborts the stage's work.
            async with self.gate.admit(stage_id, bound=stage_id in bound):
                bound.discard(stage_id)
                queue = client.add_request(request_id, request)
                self.active[request_id] = stage_id
            timer = StageTimer(request_id, stage_id, client.kind, self.stats_listeners)
            while True:
                out = await queue.get()
                timer.observe(out)
                unfinished -= out.finished
                finished = unfinished == 0 or out.error is not None
                yield out, finished
                if finished:
                    return
        finally:
            if queue is not None:
                self.active.pop(request_id, None)
                if not finished:  # the caller went away: free the stage's work
                    client.abort([request_id])

    def _to_omni_output(
        self, request_id: str, stage: StageConfig, out: OutputMessage, *, final: bool
    ) -> OmniRequestOutput:
        images = [
            OmniImage(png=image.png, width=image.width, height=image.height, seed=image.seed)
            for image in (out.images if out.finished else [])
        ]
        return OmniRequestOutput(
            request_id=request_id,
            stage_id=stage.stage_id,
            modality=self._modality(stage.stage_id),
            index=out.index,
            text_delta=out.text_delta,
            new_token_ids=list(out.new_token_ids),
            finished=out.finished,
            final=final,
            finish_reason=out.finish_reason,
            images=images,
            audio=[
                OmniAudio(
                    samples=a.samples.numpy(),
                    sample_rate=a.sample_rate,
                    voice=a.voice,
                    seed=a.seed,
                    codes=list(a.codes),
                )
                for a in (out.audio if out.finished else [])
            ],
            num_prompt_tokens=out.num_prompt_tokens,
            num_output_tokens=out.num_output_tokens,
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
        )

    async def abort(self, request_id: str) -> None:
        stage_id = self.active.get(request_id)
        if stage_id is not None:
            self.clients[stage_id].abort([request_id])
