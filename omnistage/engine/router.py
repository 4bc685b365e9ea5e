"""The data path: route one request through the chain of stages it needs.

Stage 0 streams; each stage's final output becomes the next stage's input through the input
processor the pipeline config names. Admission per stage goes through the shared
``AdmissionGate``; requests already in the pipeline are *bound* for their later stages, so a
sleep of one of those treats them by its mode when they arrive.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

from omnistage.config import PipelineConfig, StageConfig
from omnistage.engine import admission as adm
from omnistage.engine.input_processors import NEEDS_HIDDEN_STATES, StageResult, get_input_processor
from omnistage.engine.outputs import OmniImage, OmniRequestOutput
from omnistage.engine.stage_client import InProcStageClient, StageProcClient, rebuild_error
from omnistage.errors import InvalidRequestError, StageAsleepError
from omnistage.stage.messages import OutputMessage

MODALITY_OF_KIND = {"ar": "text", "diffusion": "image"}

StageClient = StageProcClient | InProcStageClient


class RequestRouter:
    """``prepare(chain)`` runs before admission (death checks, auto-wake)."""

    def __init__(
        self,
        config: PipelineConfig,
        clients: Sequence[StageClient],
        gate: adm.AdmissionGate,
        prepare: Callable[[list[int]], Awaitable[None]],
    ) -> None:
        self.config = config
        self.clients = clients
        self.gate = gate
        self._prepare = prepare
        self.active: dict[str, int] = {}  # request id -> stage currently serving it
        self._downstream = self._compute_downstream()

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

    # -- data path ----------------------------------------------------------------------

    def output_modalities(self) -> list[str]:
        return list(dict.fromkeys(MODALITY_OF_KIND[s.kind] for s in self.config.stages))

    def plan(self, modalities: Sequence[str] | None) -> list[int]:
        """The chain of stages a request with these output modalities must pass through."""
        wanted = list(modalities) if modalities else self.output_modalities()
        available = self.output_modalities()
        unknown = [m for m in wanted if m not in available]
        if unknown:
            raise InvalidRequestError(
                "modalities", f"{unknown} not produced by this pipeline; it produces {available}"
            )
        last = max(s.stage_id for s in self.config.stages if MODALITY_OF_KIND[s.kind] in wanted)
        chain = [last]
        while self.config.stages[chain[0]].input_from is not None:
            chain.insert(0, self.config.stages[chain[0]].input_from)  # type: ignore[arg-type]
        return chain

    async def generate(
        self,
        prompt: str | dict[str, Any],
        sampling_params: dict[str, Any] | None = None,
        modalities: Sequence[str] | None = None,
        *,
        image_params: dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[OmniRequestOutput]:
        """Stream a request through the pipeline.

        ``prompt`` is a string or a dict with ``prompt``, ``prompt_token_ids`` or ``messages``.
        ``sampling_params`` go to AR stages, ``image_params`` to diffusion stages. Raises
        ``StageAsleepError`` at once if a needed stage is asleep; waits while one is paused.
        """
        request_id = request_id or uuid.uuid4().hex
        wanted = list(modalities) if modalities else self.output_modalities()
        chain = self.plan(wanted)
        await self._prepare(chain)
        self.gate.check_available(chain)
        options = {"image_params": image_params or {}, "sampling_params": sampling_params or {}}
        request = self._first_request(chain, prompt, options)
        # Later stages learn that this request is on its way, so a sleep of one of them can
        # treat it by the sleep's mode when it gets there (see admission.py).
        bound = set(chain[1:])
        self.gate.add_bound(bound)
        try:
            for position, stage_id in enumerate(chain):
                stage = self.config.stages[stage_id]
                emit = MODALITY_OF_KIND[stage.kind] in wanted
                is_last = position == len(chain) - 1
                result = StageResult()
                try:
                    async for out in self._run_stage(stage_id, request_id, request, bound):
                        if out.error is not None:
                            raise rebuild_error(
                                stage_id, out.error_type, out.error, out.error_field
                            )
                        result.text += out.text_delta
                        result.token_ids.extend(out.new_token_ids)
                        ends_request = out.finished and (is_last or out.finish_reason == "abort")
                        if emit or ends_request:
                            yield self._to_omni_output(request_id, stage, out, final=ends_request)
                        if out.finished:
                            result.payload = dict(out.payload or {})
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
                        MODALITY_OF_KIND[stage.kind],
                        finished=True,
                        final=True,
                        finish_reason="abort",
                    )
                    return
                if not is_last:
                    next_stage = self.config.stages[chain[position + 1]]
                    processor = get_input_processor(next_stage.input_processor or "")
                    request = processor(result, options)
        finally:
            self.gate.release_bound(bound)

    def _first_request(
        self, chain: list[int], prompt: str | dict[str, Any], options: dict[str, Any]
    ) -> dict[str, Any]:
        first = self.config.stages[chain[0]]
        fields = {"prompt": prompt} if isinstance(prompt, str) else dict(prompt)
        allowed = {"prompt", "prompt_token_ids", "messages", "prompt_embeds", "negative_prompt"}
        unknown = set(fields) - allowed
        if unknown:
            raise InvalidRequestError(
                "prompt", f"unknown prompt fields {sorted(unknown)}; use {sorted(allowed)}"
            )
        if first.kind == "ar":
            next_stage = self._downstream.get(first.stage_id)
            needs_hidden = (
                next_stage is not None
                and next_stage in chain
                and self.config.stages[next_stage].input_processor in NEEDS_HIDDEN_STATES
            )
            return {
                **fields,
                "sampling_params": options["sampling_params"],
                "return_hidden_states": needs_hidden,
            }
        return {**fields, "params": options["image_params"]}

    async def _run_stage(
        self, stage_id: int, request_id: str, request: dict[str, Any], bound: set[int]
    ) -> AsyncIterator[OutputMessage]:
        """Submit to one stage and stream its outputs; ``bound`` holds the stages this request
        has still to reach (this one leaves it once admitted)."""
        client = self.clients[stage_id]
        queue: asyncio.Queue[OutputMessage] | None = None
        finished = False
        try:
            # The request counts as submitted inside the ``try``: a caller cancelled while
            # admission closes behind it still aborts the stage's work.
            async with self.gate.admit(stage_id, bound=stage_id in bound):
                queue = client.add_request(request_id, request)
                self.active[request_id] = stage_id
                if stage_id in bound:
                    bound.discard(stage_id)
                    self.gate.stages[stage_id].bound -= 1
            while True:
                out = await queue.get()
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            if queue is not None:
                self.active.pop(request_id, None)
                if not finished:  # the caller went away: free the stage's work
                    client.abort([request_id])

    @staticmethod
    def _to_omni_output(
        request_id: str, stage: StageConfig, out: OutputMessage, *, final: bool
    ) -> OmniRequestOutput:
        images = []
        for image in (out.payload or {}).get("images", []) if out.finished else []:
            images.append(
                OmniImage(
                    png=image["png"],
                    width=image["width"],
                    height=image["height"],
                    seed=image.get("seed"),
                )
            )
        return OmniRequestOutput(
            request_id=request_id,
            stage_id=stage.stage_id,
            modality=MODALITY_OF_KIND[stage.kind],
            text_delta=out.text_delta,
            new_token_ids=list(out.new_token_ids),
            finished=out.finished,
            final=final,
            finish_reason=out.finish_reason,
            images=images,
            num_prompt_tokens=out.num_prompt_tokens,
            num_output_tokens=out.num_output_tokens,
        )

    async def abort(self, request_id: str) -> None:
        stage_id = self.active.get(request_id)
        if stage_id is not None:
            self.clients[stage_id].abort([request_id])
