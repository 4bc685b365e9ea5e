"""The control events' log lines: one per ACK, with the fields operators read, and failures
at WARNING/ERROR with the error."""

from __future__ import annotations

import logging

from omnistage.engine.events import log_sleep, log_wake, log_weights
from omnistage.errors import InvalidRequestError
from omnistage.stage.control import make_ack

logger = logging.getLogger("omnistage.engine.control")


def only(caplog) -> tuple[logging.LogRecord, dict]:
    (record,) = caplog.records
    return record, record.omni  # type: ignore[attr-defined]


def test_a_sleep_line_carries_the_ack(caplog):
    caplog.set_level(logging.INFO, "omnistage")
    ack = make_ack(
        0, freed_bytes=4096, level=2, mode="abort", tags=["weights", "kv_cache"], latency_ms=1.23456
    )
    log_sleep(logger, "thinker", ack, trigger="idle_sleep", elapsed_ms=2.5)
    record, fields = only(caplog)
    assert record.levelno == logging.INFO
    assert record.getMessage() == "stage 0 (thinker) is asleep (level 2, 4096 bytes freed)"
    assert fields == {
        "event": "sleep",
        "stage_id": 0,
        "stage": "thinker",
        "status": "SUCCESS",
        "sleep_level": 2,
        "mode": "abort",
        "tags": ["weights", "kv_cache"],
        "freed_bytes": 4096,
        "latency_ms": 1.235,
        "elapsed_ms": 2.5,
        "trigger": "idle_sleep",
    }


def test_a_failed_sleep_or_wake_is_logged_with_its_error(caplog):
    caplog.set_level(logging.INFO, "omnistage")
    failed = make_ack(1, status="ERROR", error_msg="TimeoutError: drain", level=1, mode="wait")
    log_sleep(logger, "image-decoder", failed, trigger="api", elapsed_ms=10.0)
    record, fields = only(caplog)
    assert record.levelno == logging.WARNING
    assert record.message == "sleep of stage 1 (image-decoder) failed"
    assert fields["error"] == "TimeoutError: drain" and fields["status"] == "ERROR"
    caplog.clear()
    failed = make_ack(1, status="ERROR", error_msg="reloading failed", level=2)
    log_wake(logger, "image-decoder", failed, trigger="auto_wake", elapsed_ms=1.0, reload=True)
    record, fields = only(caplog)
    assert record.levelno == logging.ERROR and fields["trigger"] == "auto_wake"
    assert fields["error"] == "reloading failed" and fields["sleep_level"] == 2


def test_a_skipped_wake_is_info(caplog):
    caplog.set_level(logging.INFO, "omnistage")
    skipped = make_ack(0, status="SKIPPED", error_msg="not asleep", level=0)
    log_wake(logger, "thinker", skipped, trigger="api", elapsed_ms=0.1, reload=True)
    record, fields = only(caplog)
    assert record.levelno == logging.INFO and record.message == "stage 0 (thinker) is already awake"


def test_weight_updates_and_syncs(caplog):
    caplog.set_level(logging.INFO, "omnistage")
    ack = make_ack(
        0, restored_bytes=100, latency_ms=5.0, weight_sources=["a", "sync:v7"], weight_version="v7"
    )
    log_weights(logger, "weight_sync", 0, "thinker", ack, weight_version="v7")
    record, fields = only(caplog)
    assert record.message == "weight sync of stage 0 (thinker) applied (version v7)"
    assert fields["weight_version"] == "v7" and fields["weight_sources"] == 2
    assert fields["restored_bytes"] == 100 and fields["latency_ms"] == 5.0
    caplog.clear()
    error = InvalidRequestError("path", "no such file")
    log_weights(logger, "update_weights", 0, "thinker", error, path="/x")
    record, fields = only(caplog)
    assert record.levelno == logging.WARNING and fields["path"] == "/x"
    assert fields["status"] == "ERROR" and "no such file" in fields["error"]
