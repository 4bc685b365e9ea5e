"""The data path: route one request through the chain of stages it needs.

The first stage's request is prepared here, in the API process (tokenized and validated by
its kind's preparer, on a worker thread so a large prompt never stalls the event loop; a
prompt with media on one of ``media_threads`` threads of its own, so that few are processed
at once and text requests never queue behind them, the memory given back after). Each
stage streams what the client gets; what the next stage takes goes stage to stage
(``omnistage.stage.handoff``): a stage that feeds another leaves its finished output there
and answers with a reference, which travels on with the next stage's request — made here
from the user's parameters only, its prompt filled in that stage by the processor the
pipeline config names. Admission per stage goes through the shared ``AdmissionGate``;
requests already in the pipeline are *bound* for their later stages, so a sleep of one of
those treats them by its mode when they arrive.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from omnistage.config import PipelineConfig, StageConfig
from omnistage.engine import admission as adm
from omnistage.engine.outputs import OmniRequestOutput
from omnistage.engine.request_stats import StageTimer, StatsListener
from omnistage.engine.stage_client import EngineStageClient
from omnistage.engine.streamed import AudioJoin, StageRun, run_streamed
from omnistage.errors import InvalidRequestError, StageAsleepError, StageInternalError
from omnistage.memory.heap import give_back_memory
from omnistage.models import registry
from omnistage.models.processors import Wants
from omnistage.stage.kinds import stage_kind
from omnistage.stage.messages import HandoffRef, OutputMessage, StageRequest, Upstream
from omnistage.stage.request_preparer import (
    RequestOptions,
    RequestPreparer,
    prompt_fields,
    prompt_options,
)


class RequestRouter:
    """``prepare(chain)`` runs before admission (auto-wake). ``media_threads``: prompts with
    media prepared at once (decoding's features and placeholders; the server sets it from
    ``--media-decode-workers``)."""

    media_threads = 2

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
        self._media_pool: ThreadPoolExecutor | None = None

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
        """What the stage outputs: its kind's modality, unless its model says otherwise (a
        token stage whose tokens are codes outputs "codes", never shown)."""
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

    def _processor_name(self, stage_id: int) -> str:
        return self.config.stages[stage_id].input_processor or ""

    def _wants(self, stage_id: int, chain: list[int], options: RequestOptions) -> Wants:
        """What the next stage of ``chain`` needs from ``stage_id``."""
        next_stage = self._downstream.get(stage_id)
        if next_stage is None or next_stage not in chain:
            return Wants()
        processor = registry.processor(self._processor_name(next_stage))
        wants: Wants = processor.wants(self.config.stages[next_stage].model, options.params)
        if self.config.stages[next_stage].stream:  # its rows go on as they are made
            wants = dataclasses.replace(wants, streamed=True)
        return wants

    def _prepare_request(
        self, stage_id: int, prompt: dict[str, Any], options: RequestOptions, chain: list[int]
    ) -> StageRequest:
        wants = self._wants(stage_id, chain, options)
        return self.preparer(stage_id).prepare(prompt, options, wants)

    async def _prepare_first(
        self, stage_id: int, prompt: dict[str, Any], options: RequestOptions, chain: list[int]
    ) -> StageRequest:
        """The first stage's request, off the event loop (see the module docstring)."""
        if not prompt.get("multi_modal_data"):
            return await asyncio.to_thread(self._prepare_request, stage_id, prompt, options, chain)
        if self._media_pool is None:
            self._media_pool = ThreadPoolExecutor(
                self.media_threads, thread_name_prefix="omnistage-prepare-media"
            )

        def prepare() -> StageRequest:
            try:
                return self._prepare_request(stage_id, prompt, options, chain)
            finally:
                give_back_memory()

        return await asyncio.get_running_loop().run_in_executor(self._media_pool, prepare)

    def _template(self, stage_id: int, options: RequestOptions, chain: list[int]) -> StageRequest:
        """The request of a stage fed by the one before: the user's parameters, its prompt
        left for the stage to fill from the hand-off."""
        wants = self._wants(stage_id, chain, options)
        return self.preparer(stage_id).template(options, wants)

    def check(
        self, prompt: str | dict[str, Any], options: RequestOptions, wanted: list[str]
    ) -> tuple[list[int], dict[str, Any], RequestOptions, int]:
        """Everything of a request that can be checked before a stage runs, checked
        (``InvalidRequestError`` naming the field): its chain of stages, its first stage's
        prompt fields, its options spelled each stage's way (a voice in any case), and its
        number of samples."""
        chain = self.plan(wanted)
        prompt, options = prompt_options(prompt, options)  # what a route's prompt adds
        fields = prompt_fields(prompt, self.preparer(chain[0]).PROMPT_FIELDS)
        num_samples = self.preparer(chain[0]).num_samples(options)
        if num_samples != 1 and len(chain) > 1:
            raise InvalidRequestError(
                "n", "several samples are served for requests one stage answers (text only)"
            )
        for stage_id in chain:
            options = self.preparer(stage_id).normalize(options)
        for stage_id in chain:
            self.preparer(stage_id).check_options(options, downstream=stage_id != chain[0])
        return chain, fields, options, num_samples

    async def generate(
        self,
        prompt: str | dict[str, Any],
        options: RequestOptions,
        modalities: Sequence[str] | None = None,
        *,
        request_id: str | None = None,
    ) -> AsyncIterator[OmniRequestOutput]:
        """Stream a request through the pipeline.

        ``prompt`` is a string or a mapping of the first stage's prompt fields (``prompt``,
        ``prompt_token_ids``, ``messages``, ...). Raises ``InvalidRequestError`` before any
        stage is touched if the request does not fit, ``StageAsleepError`` at once (naming
        every stage asleep) if a needed stage is asleep; waits while one is paused.
        """
        request_id = request_id or uuid.uuid4().hex
        started = time.monotonic()
        wanted = list(modalities) if modalities else self.output_modalities()
        chain, fields, options, num_samples = self.check(prompt, options, wanted)
        await self._prepare(chain)
        self.gate.check_available(chain)
        request = await self._prepare_first(chain[0], fields, options, chain)
        del prompt, fields  # decoded media are inputs now: not held while the request runs
        # Later stages learn that this request is on its way, so a sleep of one of them can
        # treat it by the sleep's mode when it gets there (see admission.py). Checked again
        # first, with no await in between: a sleep that began while the prompt was prepared
        # drained without counting this request, which must not go in behind its back.
        bound = set(chain[1:])
        self.gate.check_available(chain)
        self.gate.add_bound(bound)
        # What a stage left for the next one and no stage has taken yet: (its stage, where).
        pending: list[tuple[int, HandoffRef]] = []
        try:
            position = 0
            while position < len(chain):
                end = position + 1
                while end < len(chain) and self.config.stages[chain[end]].stream:
                    end += 1  # a run of streamed edges runs as one group
                group = chain[position:end]
                streamed = len(group) > 1
                ends_chain = group[-1] == chain[-1]
                joiner = AudioJoin()
                try:
                    outputs = self._run_group(
                        group, request_id, request, options, chain, bound, pending,
                        num_samples if position == 0 else 1, started,
                    )  # fmt: skip
                    async for stage_id, out, is_last_sample in outputs:
                        if out.error is not None:
                            raise out.error.rebuild(stage_id)
                        if is_last_sample and out.handoff is not None:
                            pending.append((stage_id, out.handoff))
                        ends_request = is_last_sample and (
                            (ends_chain and stage_id == group[-1]) or out.finish_reason == "abort"
                        )
                        if self._modality(stage_id) in wanted or ends_request:
                            yield self._to_omni_output(
                                request_id,
                                self.config.stages[stage_id],
                                out,
                                final=ends_request,
                                joiner=joiner if streamed and stage_id == group[-1] else None,
                            )
                        if is_last_sample and out.finish_reason == "abort":
                            return
                except StageAsleepError as exc:
                    # Reaching a stage that an "abort" sleep took down while this request was
                    # upstream: the request was in flight, so it ends as aborted.
                    asleep = exc.stage_ids[0]
                    if asleep == chain[0] or self.gate.stages[asleep].sleep_mode != "abort":
                        raise
                    yield OmniRequestOutput(
                        request_id,
                        asleep,
                        self._modality(asleep),
                        finished=True,
                        final=True,
                        finish_reason="abort",
                    )
                    return
                position += len(group)
                if position < len(chain):
                    if not pending:
                        raise StageInternalError(f"stage {group[-1]} handed nothing over")
                    request = self._template(chain[position], options, chain)
        finally:
            self.gate.release_bound(bound)
            for producer, ref in pending:  # left for a stage the request never reached
                self.clients[producer].discard(ref)

    def _run_group(
        self,
        group: list[int],
        request_id: str,
        request: StageRequest,
        options: RequestOptions,
        chain: list[int],
        bound: set[int],
        pending: list[tuple[int, HandoffRef]],
        num_samples: int,
        started: float,
    ) -> AsyncIterator[tuple[int, OutputMessage, bool]]:
        """One stage's outputs, or two stages' joined by a streamed edge (``streamed.py``),
        as ``(stage_id, output, ends_that_stage)``."""
        first = group[0]
        upstream = None
        if pending:
            params = {name: dict(value) for name, value in options.params.items()}
            upstream = Upstream(pending[0][1], self._processor_name(first), params)
        run = StageRun(
            first,
            request_id,
            request,
            bound,
            num_samples=num_samples,
            forward=len(group) == 1 and first != chain[-1],
            upstream=upstream,
            on_submit=pending.clear,
            request_start=started,
        )
        if len(group) == 1:
            return self._tagged(first, self._run_stage(run))
        stages = [run]
        params = {name: dict(value) for name, value in options.params.items()}
        for later in group[1:]:
            stages.append(
                StageRun(
                    later,
                    request_id,
                    self._template(later, options, chain),
                    bound,
                    forward=later == group[-1] and later != chain[-1],
                    stream=self._processor_name(later),
                    stream_params=params,
                    request_start=started,
                )
            )
        clients = [self.clients[later] for later in group[1:]]
        return run_streamed(
            self._run_stage,
            stages,
            [functools.partial(client.append_input, request_id) for client in clients],
            [functools.partial(client.abort, [request_id]) for client in clients],
        )

    @staticmethod
    async def _tagged(
        stage_id: int, outputs: AsyncIterator[tuple[OutputMessage, bool]]
    ) -> AsyncIterator[tuple[int, OutputMessage, bool]]:
        async for out, ends in outputs:
            yield stage_id, out, ends

    async def _run_stage(self, run: StageRun) -> AsyncIterator[tuple[OutputMessage, bool]]:
        """Submit ``run`` to its stage and stream the stage's outputs, each with whether it
        ends the last of the run's samples."""
        stage_id, request_id, bound = run.stage_id, run.request_id, run.bound
        client = self.clients[stage_id]
        queue: asyncio.Queue[OutputMessage] | None = None
        finished = False
        unfinished = run.num_samples
        try:
            # The request counts as submitted inside the ``try``: a caller cancelled while
            # admission closes behind it still aborts the stage's work.
            async with self.gate.admit(stage_id, bound=stage_id in bound):
                bound.discard(stage_id)
                queue = client.add_request(
                    request_id,
                    run.request,
                    forward=run.forward,
                    upstream=run.upstream,
                    stream=run.stream,
                    params=run.stream_params,
                )
                run.on_submit()  # the stage takes (or refuses) what was handed to it
                self.active[request_id] = stage_id
            timer = StageTimer(
                request_id, stage_id, client.kind, self.stats_listeners, run.request_start
            )
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
        self,
        request_id: str,
        stage: StageConfig,
        out: OutputMessage,
        *,
        final: bool,
        joiner: AudioJoin | None = None,
    ) -> OmniRequestOutput:
        """``joiner``: the stage's media comes in pieces (a streamed edge): each output carries
        its piece in ``media_delta`` and the last one the whole in ``media``."""
        if joiner is not None:
            delta = joiner.add(out.media)
            media = joiner.whole(delta) if out.finished else []
        else:
            delta, media = [], [m.to_client() for m in (out.media if out.finished else [])]
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
            media=media,
            media_delta=delta,
            num_prompt_tokens=out.num_prompt_tokens,
            num_output_tokens=out.num_output_tokens,
            num_cached_tokens=out.num_cached_tokens,
            logprobs=out.logprobs,
            prompt_logprobs=out.prompt_logprobs,
        )

    async def abort(self, request_id: str) -> None:
        stage_id = self.active.get(request_id)
        if stage_id is not None:
            self.clients[stage_id].abort([request_id])
