"""Request and response models of the ``/v1/omni/*`` control routes.

``OmniSleepRequest`` and ``OmniWakeupRequest`` are vLLM-Omni's models (``stage_ids`` and
``level: int = 2``) with omnistage's optional extension fields. Every extension field defaults
to ``None``, meaning "not sent": the routes pass only the fields a client really sent on to the
engine client, so a body with just vLLM-Omni's fields produces exactly vLLM-Omni's engine call.

Validation is strict (``"2"``, ``1.5`` or ``true`` are not integers; ``"true"`` is not a boolean)
so that a malformed body is refused with the field named instead of being guessed at. Levels,
modes and tags are checked by the control vocabulary's own checks
(``omnistage.stage.vocabulary``), so a bad one is refused with the same words here as by the
engine client and the stages.

Unknown body keys are accepted and ignored (``extra="allow"`` keeps them visible as
``ignored_fields`` so the route can log them): vLLM-Omni clients may send keys omnistage does not
know, and refusing them would break the promise that those clients work unchanged.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
)
from pydantic_core import PydanticCustomError

from omnistage.errors import InvalidRequestError
from omnistage.stage.vocabulary import (
    ACK_STATUSES,
    DEFAULT_SLEEP_LEVEL,
    KNOWN_TAGS,
    SLEEP_LEVELS,
    SLEEP_MODES,
    check_level,
    check_mode,
    check_tags,
)


def _checked(check: Callable[[Any], Any]) -> AfterValidator:
    """A pydantic validator that refuses with ``check``'s own words."""

    def validate(value: Any) -> Any:
        try:
            check(value)
        except InvalidRequestError as exc:
            raise PydanticCustomError("invalid_value", exc.reason) from None
        return value

    return AfterValidator(validate)


def _one_of(values: tuple[Any, ...]) -> Any:
    return Field(json_schema_extra={"enum": list(values)})


StageId = Annotated[StrictInt, Field(ge=0)]
ReplicaIds = Annotated[list[Annotated[StrictInt, Field(ge=0)]], Field(min_length=1)]
SleepLevel = Annotated[StrictInt, _checked(check_level), _one_of(SLEEP_LEVELS)]
QuerySleepLevel = Annotated[int, _checked(check_level), _one_of(SLEEP_LEVELS)]  # "?level=2"
SleepMode = Annotated[StrictStr, _checked(check_mode), _one_of(SLEEP_MODES)]
MemoryTags = Annotated[
    list[StrictStr],
    _checked(check_tags),
    Field(json_schema_extra={"items": {"enum": list(KNOWN_TAGS)}}),
]
AckStatus = Annotated[StrictStr, _one_of(ACK_STATUSES)]


class ControlRequest(BaseModel):
    """Base of the control request bodies: strict fields, unknown keys kept aside."""

    model_config = ConfigDict(extra="allow")

    @property
    def ignored_fields(self) -> list[str]:
        """Body keys this model does not know; they have no effect."""
        return sorted(self.model_extra or {})


class OmniSleepRequest(ControlRequest):
    """Body of ``POST /v1/omni/sleep``.

    ``replica_ids`` (omnistage's): only those replicas of each stage; a stage that serves on
    its other replicas stays awake.

    ``level``: 1 offloads weights to host memory and discards the KV cache, 2 discards both
    (wake reloads weights from the checkpoint), 0 pauses scheduling only. ``mode`` says what
    happens to requests in flight (engine default: ``abort``); ``tags`` limits which memory is
    released (engine default: all tags the level implies).
    """

    stage_ids: list[StageId]
    level: SleepLevel = DEFAULT_SLEEP_LEVEL
    mode: SleepMode | None = None
    tags: MemoryTags | None = None
    replica_ids: ReplicaIds | None = None


class OmniWakeupRequest(ControlRequest):
    """Body of ``POST /v1/omni/wakeup``.

    ``replica_ids`` (omnistage's): only those replicas of each stage.

    ``tags`` wakes only that memory (engine default: all); ``reload: false`` leaves level-2
    weights invalid for the caller to push new ones (``update_weights``); ``resume: false`` keeps
    the woken stages paused (the server's default is to resume them).
    """

    stage_ids: list[StageId]
    tags: MemoryTags | None = None
    reload: StrictBool | None = None
    resume: StrictBool | None = None
    replica_ids: ReplicaIds | None = None


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
    """Reply of the control operations, as vLLM-Omni's: ``{"status", "acks"}``, plus a
    ``reason`` when the status is not ``SUCCESS``.

    ``status`` is ``ERROR`` when any ACK reports ``ERROR`` (the HTTP status is still 200: the
    operation ran and the ACKs say per stage and rank what happened; ``reason`` names the
    failed stages), ``SKIPPED`` when nothing had to change (a wake of stages that do not sleep,
    a sleep of stages asleep already): ``reason`` says which, and the ACKs are there as for any
    other answer. Routes serialise it without ``None`` fields.
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
