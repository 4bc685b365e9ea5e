"""Request and response models of the ``/v1/omni/*`` control routes.

``OmniSleepRequest`` and ``OmniWakeupRequest`` are vLLM-Omni's models (``stage_ids`` and
``level: int = 2``) with omnistage's optional extension fields. Every extension field defaults
to ``None``, meaning "not sent": the routes pass only the fields a client really sent on to the
engine client, so a body with just vLLM-Omni's fields produces exactly vLLM-Omni's engine call.

Validation is strict (``"2"``, ``1.5`` or ``true`` are not integers; ``"true"`` is not a boolean)
so that a malformed body is refused with the field named instead of being guessed at.

Unknown body keys are accepted and ignored (``extra="allow"`` keeps them visible as
``ignored_fields`` so the route can log them): vLLM-Omni clients may send keys omnistage does not
know, and refusing them would break the promise that those clients work unchanged.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

StageId = Annotated[StrictInt, Field(ge=0)]
SleepLevel = Annotated[StrictInt, Field(ge=0, le=2)]
SleepMode = Literal["abort", "wait", "keep"]
MemoryTag = Literal["weights", "kv_cache"]
AckStatus = Literal["SUCCESS", "ERROR", "SKIPPED"]

ALL_MEMORY_TAGS: frozenset[str] = frozenset({"weights", "kv_cache"})


class ControlRequest(BaseModel):
    """Base of the control request bodies: strict fields, unknown keys kept aside."""

    model_config = ConfigDict(extra="allow")

    @property
    def ignored_fields(self) -> list[str]:
        """Body keys this model does not know; they have no effect."""
        return sorted(self.model_extra or {})


class OmniSleepRequest(ControlRequest):
    """Body of ``POST /v1/omni/sleep``.

    ``level``: 1 offloads weights to host memory and discards the KV cache, 2 discards both
    (wake reloads weights from the checkpoint), 0 pauses scheduling only. ``mode`` says what
    happens to requests in flight (engine default: ``abort``); ``tags`` limits which memory is
    released (engine default: all tags the level implies).
    """

    stage_ids: list[StageId]
    level: SleepLevel = 2
    mode: SleepMode | None = None
    tags: list[MemoryTag] | None = Field(default=None, min_length=1)


class OmniWakeupRequest(ControlRequest):
    """Body of ``POST /v1/omni/wakeup``.

    ``tags`` wakes only that memory (engine default: all); ``reload: false`` leaves level-2
    weights invalid for the caller to push new ones (``update_weights``); ``resume: false`` keeps
    the woken stages paused (the server's default is to resume them).
    """

    stage_ids: list[StageId]
    tags: list[MemoryTag] | None = Field(default=None, min_length=1)
    reload: StrictBool | None = None
    resume: StrictBool | None = None


class OmniPauseRequest(ControlRequest):
    """Body of ``POST /v1/omni/pause``; ``stage_ids`` ``None`` (or no body) pauses every stage."""

    stage_ids: list[StageId] | None = None
    mode: SleepMode = "abort"


class OmniResumeRequest(ControlRequest):
    """Body of ``POST /v1/omni/resume``; ``stage_ids`` ``None`` (or no body) resumes every stage."""

    stage_ids: list[StageId] | None = None


class OmniUpdateWeightsRequest(ControlRequest):
    """Body of ``POST /v1/omni/update_weights``: load a safetensors checkpoint into a stage."""

    stage_id: StageId
    path: StrictStr = Field(min_length=1)


class OmniControlResponse(BaseModel):
    """Reply of the control operations, as vLLM-Omni's: ``{"status", "acks"}`` or ``{"status", "reason"}``.

    ``status`` is ``ERROR`` when any ACK reports ``ERROR`` (the HTTP status is still 200: the
    operation ran and the ACKs say per stage what happened; ``reason`` names the failed stages).
    Routes serialise it without ``None`` fields so vLLM-Omni's exact bodies come out.
    """

    status: AckStatus
    acks: list[dict[str, Any]] | None = None
    reason: str | None = None


class OmniStagesResponse(BaseModel):
    """Reply of ``GET /v1/omni/stages``: the engine's per-stage status dicts, in stage order.

    Each holds ``stage_id``, ``kind``, ``state`` (awake, sleeping, asleep, waking, failed, dead),
    ``level``, ``sleeping_tags``, ``paused``, ``in_flight``, ``weights_valid`` and memory figures.
    """

    stages: list[dict[str, Any]]


class IsSleepingResponse(BaseModel):
    """Reply of vLLM's ``GET /is_sleeping``."""

    is_sleeping: bool


class IsPausedResponse(BaseModel):
    """Reply of vLLM's ``GET /is_paused``."""

    is_paused: bool
