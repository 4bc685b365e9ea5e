"""``omnistage.logs``: the text and JSON formats with structured fields, a configuration that
replaces itself, leaves the root logger alone and reaches spawned processes; and the stage
process title."""

from __future__ import annotations

import importlib.util
import json
import logging
import multiprocessing
import os
import re
import sys
from typing import Any

import pytest

from omnistage import logs
from omnistage.logs import configure_from_env, configure_logging, log_event

ENV = (logs.LEVEL_ENV, logs.FORMAT_ENV)
TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3} INFO omnistage\.engine\.control: stage 0 \(thinker\) "
    r"is asleep event=sleep stage_id=0 stage=thinker sleep_level=2 tags=weights,kv_cache "
    r"freed_bytes=52428800 latency_ms=0\.25 error=\"a b=c\"$"
)


@pytest.fixture(autouse=True)
def restore_logging(monkeypatch):
    """Each test starts unconfigured and leaves the loggers (and environment) as it found them."""
    for name in ENV:
        monkeypatch.delenv(name, raising=False)
    names = [*logs.CONFIGURED_LOGGERS, "uvicorn.error", "uvicorn.access", "uvicorn.asgi"]
    saved = {n: (list(logging.getLogger(n).handlers), logging.getLogger(n).level) for n in names}
    propagate = {n: logging.getLogger(n).propagate for n in names}
    yield
    for n, (handlers, level) in saved.items():
        logger = logging.getLogger(n)
        logger.handlers[:] = handlers
        logger.setLevel(level)
        logger.propagate = propagate[n]


def emit(**fields: Any) -> None:
    log_event(
        logging.getLogger("omnistage.engine.control"),
        logging.INFO,
        "sleep",
        "stage 0 (thinker) is asleep",
        **fields,
    )


SLEEP_FIELDS = {
    "stage_id": 0,
    "stage": "thinker",
    "sleep_level": 2,
    "tags": ["weights", "kv_cache"],
    "freed_bytes": 52428800,
    "latency_ms": 0.25,
    "error": "a b=c",
    "absent": None,
}


def test_text_lines_have_time_level_logger_message_and_fields(capsys):
    configure_logging("info", "text")
    emit(**SLEEP_FIELDS)
    (line,) = capsys.readouterr().err.splitlines()
    assert TEXT_LINE.match(line), line


def test_json_lines_carry_the_fields_at_the_top_level(capsys):
    configure_logging("info", "json")
    emit(**SLEEP_FIELDS, time="a field named like a standard key")
    (line,) = capsys.readouterr().err.splitlines()
    record = json.loads(line)
    assert list(record)[:4] == ["time", "level", "logger", "message"]
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}\+00:00$", record["time"])
    assert record["level"] == "INFO" and record["logger"] == "omnistage.engine.control"
    assert record["message"] == "stage 0 (thinker) is asleep" and record["event"] == "sleep"
    assert record["tags"] == ["weights", "kv_cache"] and record["freed_bytes"] == 52428800
    assert record["field_time"] == "a field named like a standard key"
    assert "absent" not in record


def test_plain_extra_and_exceptions(capsys):
    configure_logging("debug", "json")
    logger = logging.getLogger("omnistage.test")
    logger.info("plain %s", "args", extra={"omni": {"request_id": "r-1"}})
    try:
        raise ValueError("boom")
    except ValueError:
        logger.exception("failed")
    first, second = map(json.loads, capsys.readouterr().err.splitlines())
    assert first["message"] == "plain args" and first["request_id"] == "r-1"
    assert second["level"] == "ERROR" and "ValueError: boom" in second["exc_info"]


def test_the_level_filters_and_uvicorn_logs_alike(capsys):
    configure_logging("warning", "text")
    logging.getLogger("omnistage.engine.control").info("hidden")
    logging.getLogger("uvicorn.access").info("hidden too")
    logging.getLogger("uvicorn.error").warning("Shown %d", 1)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.endswith(" WARNING uvicorn.error: Shown 1")


def test_configuring_again_replaces_the_configuration(capsys):
    root_handlers = list(logging.getLogger().handlers)
    for fmt in ("text", "json", "json"):
        configure_logging("info", fmt)
    for name in logs.CONFIGURED_LOGGERS:
        logger = logging.getLogger(name)
        assert len(logger.handlers) == 1 and not logger.propagate
    assert logging.getLogger().handlers == root_handlers  # third-party logging untouched
    logging.getLogger("omnistage.x").info("once")
    (line,) = capsys.readouterr().err.splitlines()
    assert json.loads(line)["message"] == "once"


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="log level"):
        configure_logging("verbose", "text")
    with pytest.raises(ValueError, match="log format"):
        configure_logging("info", "xml")


def test_settings_are_exported_for_stage_processes(monkeypatch):
    assert configure_from_env() is False  # nobody asked: nothing is configured
    assert not logging.getLogger("omnistage").handlers
    configure_logging("DEBUG", "json")
    assert {n: os.environ[n] for n in ENV} == {
        logs.LEVEL_ENV: "debug",
        logs.FORMAT_ENV: "json",
    }
    monkeypatch.setenv(logs.FORMAT_ENV, "yaml")
    assert configure_from_env() is True  # a bad value falls back to text
    assert isinstance(logging.getLogger("omnistage").handlers[0].formatter, logs.TextFormatter)


def _child_logs() -> None:
    configure_from_env()
    log_event(logging.getLogger("omnistage.stage.proc"), logging.INFO, "ping", "hello", n=1)


def test_a_spawned_process_logs_like_its_parent(capfd):
    configure_logging("info", "json")
    child = multiprocessing.get_context("spawn").Process(
        target=_child_logs, name="omnistage-stage3-test"
    )
    child.start()
    child.join(60)
    assert child.exitcode == 0
    (line,) = [line for line in capfd.readouterr().err.splitlines() if line.startswith("{")]
    record = json.loads(line)
    assert record["message"] == "hello" and record["event"] == "ping" and record["n"] == 1
    assert record["process"] == "omnistage-stage3-test"


def _child_titles(queue: Any) -> None:
    from omnistage.stage.proc import set_process_title

    def read() -> tuple[str, str]:
        with open("/proc/self/comm") as comm, open("/proc/self/cmdline", "rb") as cmdline:
            return comm.read().strip(), cmdline.read().replace(b"\0", b" ").decode().strip()

    sys.modules["setproctitle"] = None  # type: ignore[assignment]  # not installed
    set_process_title("omnistage-stage7-image-decoder", "stage7-image-decoder")
    without = read()
    del sys.modules["setproctitle"]
    set_process_title("omnistage-stage7-image-decoder", "stage7-image-decoder")
    queue.put((without, read()))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc and prctl are Linux's")
def test_stage_process_title_with_and_without_setproctitle():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_child_titles, args=(queue,))
    child.start()
    without, with_it = queue.get(timeout=60)
    child.join(10)
    # Without the package only the name (15 characters: all it holds) changes.
    assert without[0] == "stage7-image-de" and "omnistage-stage7" not in without[1]
    if importlib.util.find_spec("setproctitle") is not None:
        assert with_it == ("stage7-image-de", "omnistage-stage7-image-decoder")


def test_stage_titles_name_the_stage():
    from omnistage.config import StageConfig
    from omnistage.stage.proc import process_title, short_name

    config = StageConfig(stage_id=0, kind="ar", model="m", name="thinker")
    assert process_title(config) == "omnistage-stage0-thinker"
    assert short_name(config) == "stage0-thinker"
    unnamed = StageConfig(stage_id=12, kind="diffusion", model="m")
    assert short_name(unnamed) == "stage12-diffusi"
