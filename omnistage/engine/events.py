"""The engine client's operator log lines: one per control event, with structured fields
(see ``omnistage.logs`` and the "Logs" section of ``docs/control-plane.md``).

Every line carries ``event``, ``stage_id`` and ``stage`` (the stage's display name). Sleep,
wake and weight updates are logged from the ACK each stage answered; a failure carries
``error``. Nothing here is logged per request, token or step.
"""

from __future__ import annotations

import logging
from typing import Any

from omnistage.logs import log_event
from omnistage.stage.control import Ack

# What started a sleep or wake.
TRIGGER_API = "api"  # a control route or the Python API
TRIGGER_AUTO_WAKE = "auto_wake"  # a request needed an asleep stage (--auto-wake)
TRIGGER_IDLE_SLEEP = "idle_sleep"  # no request for idle_sleep_s (--idle-sleep-s)


def _ms(value: float) -> float:
    return round(value, 3)


def _fields(stage: str, ack: Ack, trigger: str, elapsed_ms: float) -> dict[str, Any]:
    """What a sleep's and a wake's log lines both carry."""
    return {
        "stage_id": ack.stage_id,
        "stage": stage,
        "status": ack.status,
        "sleep_level": ack.metadata.level,
        "tags": ack.metadata.tags,
        "latency_ms": _ms(ack.metadata.latency_ms),
        "elapsed_ms": _ms(elapsed_ms),
        "trigger": trigger,
    }


def log_sleep(
    logger: logging.Logger, stage: str, ack: Ack, *, trigger: str, elapsed_ms: float
) -> None:
    m = ack.metadata
    name = f"stage {ack.stage_id} ({stage})"
    fields = _fields(stage, ack, trigger, elapsed_ms)
    fields.update(mode=m.mode, freed_bytes=ack.freed_bytes)
    if m.host_backup_bytes:
        fields["host_backup_bytes"] = m.host_backup_bytes
    if m.gbps:
        fields["gbps"] = m.gbps
    if m.aborted or m.preempted:
        fields.update(aborted=m.aborted, preempted=m.preempted)
    done = f"{name} is asleep (level {m.level}, {ack.freed_bytes} bytes freed)"
    _log_outcome(logger, "sleep", ack, fields, logging.WARNING, f"{name} is already asleep", done)


def log_wake(
    logger: logging.Logger,
    stage: str,
    ack: Ack,
    *,
    trigger: str,
    elapsed_ms: float,
    reload: bool,
) -> None:
    m = ack.metadata
    name = f"stage {ack.stage_id} ({stage})"
    fields = _fields(stage, ack, trigger, elapsed_ms)  # sleep_level: the level it woke from
    fields.update(
        restored_bytes=m.restored_bytes, gbps=m.gbps, reload=reload, weights_valid=m.weights_valid
    )
    if m.reload_gbps:
        fields["reload_gbps"] = m.reload_gbps
    done = f"{name} is awake (from level {m.level})"
    _log_outcome(logger, "wake", ack, fields, logging.ERROR, f"{name} is already awake", done)


def _log_outcome(
    logger: logging.Logger,
    event: str,
    ack: Ack,
    fields: dict[str, Any],
    failure_severity: int,
    skipped: str,
    done: str,
) -> None:
    """The line of a sleep or wake ACK: failed (with the error), skipped, or done."""
    if ack.status == "ERROR":
        fields.update(sleeping_tags=ack.metadata.sleeping_tags, error=ack.error_msg)
        stage = f"stage {ack.stage_id} ({fields['stage']})"
        log_event(logger, failure_severity, event, f"{event} of {stage} failed", **fields)
    else:
        message = skipped if ack.status == "SKIPPED" else done
        log_event(logger, logging.INFO, event, message, **fields)


def log_weights(
    logger: logging.Logger,
    event: str,
    stage_id: int,
    stage: str,
    result: Ack | BaseException,
    **fields: Any,
) -> None:
    """``update_weights`` (a file; ``path``) or a weight sync's finish (``weight_version``)."""
    name = f"stage {stage_id} ({stage})"
    what = "weight update" if event == "update_weights" else "weight sync"
    common: dict[str, Any] = {"stage_id": stage_id, "stage": stage, **fields}
    if isinstance(result, BaseException):
        error = f"{type(result).__name__}: {result}"
        message = f"{what} of {name} failed"
        log_event(logger, logging.WARNING, event, message, **common, status="ERROR", error=error)
        return
    m = result.metadata
    common.update(
        status=result.status,
        restored_bytes=m.restored_bytes,
        latency_ms=_ms(m.latency_ms),
        weights_valid=m.weights_valid,
        weight_sources=len(m.weight_sources) if m.weight_sources is not None else None,
    )
    if m.weight_version:
        common["weight_version"] = m.weight_version
    if result.status == "ERROR":
        message = f"{what} of {name} failed"
        log_event(logger, logging.WARNING, event, message, **common, error=result.error_msg)
    else:
        version = f" (version {m.weight_version})" if m.weight_version else ""
        log_event(logger, logging.INFO, event, f"{what} of {name} applied{version}", **common)
