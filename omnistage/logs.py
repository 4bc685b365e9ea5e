"""Log lines for operators: ``configure_logging(level, fmt)`` sets up the ``omnistage`` (and
uvicorn's) loggers once, at the start of ``omnistage serve``; library users' logging is left
alone unless they call it.

Two formats, one line per record, on stderr:

- ``text``: ``2026-12-01 10:00:00.123 INFO omnistage.engine.control: stage 0 (thinker) asleep
  stage_id=0 stage=thinker level=2 freed_bytes=52428800 latency_ms=0.3 trigger=api``
- ``json``: ``{"time": "2026-12-01T10:00:00.123+00:00", "level": "INFO", "logger": ...,
  "message": ..., "stage_id": 0, "stage": "thinker", ...}``

Structured fields travel in one place: ``extra={"omni": {...}}`` (or ``log_event``, which
builds it). The text format appends them as ``key=value``; the JSON format puts them at the top
level of the object (a field named like a standard key gets a ``field_`` prefix). Records from a
process other than the main one (a stage process) carry ``process=<its name>``.

Stage processes log the same way: ``configure_logging`` exports ``OMNISTAGE_LOG_LEVEL`` and
``OMNISTAGE_LOG_FORMAT``; a spawned child inherits them and calls ``configure_from_env``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

LEVELS = ("debug", "info", "warning", "error")
FORMATS = ("text", "json")
LEVEL_ENV = "OMNISTAGE_LOG_LEVEL"
FORMAT_ENV = "OMNISTAGE_LOG_FORMAT"
FIELDS_ATTR = "omni"  # extra={"omni": {...}}: a record's structured fields
CONFIGURED_LOGGERS = ("omnistage", "uvicorn")  # uvicorn.error and uvicorn.access propagate
_STANDARD_KEYS = frozenset({"time", "level", "logger", "message", "process", "exc_info"})


def record_fields(record: logging.LogRecord) -> dict[str, Any]:
    """The structured fields of ``record`` (``extra={"omni": {...}}``), plus ``process`` for a
    record logged outside the main process."""
    fields = getattr(record, FIELDS_ATTR, None)
    out = dict(fields) if isinstance(fields, Mapping) else {}
    if record.processName not in (None, "MainProcess"):
        out.setdefault("process", record.processName)
    return out


def _text_value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}" if abs(value) < 1e6 else str(round(value))
    if isinstance(value, list | tuple) and all(isinstance(v, str | int) for v in value):
        return ",".join(str(v) for v in value) if value else "[]"
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    needs_quotes = not text or any(c.isspace() or c in '="' for c in text)
    return json.dumps(text) if needs_quotes else text


class TextFormatter(logging.Formatter):
    """``<local time, ms> LEVEL logger: message key=value ...``"""

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(record.created))
        line = (
            f"{stamp}.{int(record.msecs):03d} {record.levelname} {record.name}: "
            f"{record.getMessage()}"
        )
        fields = record_fields(record)
        if fields:
            line += " " + " ".join(f"{k}={_text_value(v)}" for k, v in fields.items())
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        elif record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``time`` (ISO 8601, UTC, ms), ``level``, ``logger``,
    ``message``, then the record's structured fields; ``exc_info`` holds a traceback."""

    def format(self, record: logging.LogRecord) -> str:
        created = datetime.fromtimestamp(record.created, tz=timezone.utc)
        obj: dict[str, Any] = {
            "time": created.isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key, value in record_fields(record).items():
            obj[f"field_{key}" if key in obj else key] = value
        if record.exc_info:
            obj["exc_info"] = self.formatException(record.exc_info)
        elif record.stack_info:
            obj["exc_info"] = self.formatStack(record.stack_info)
        return json.dumps(obj, default=str, ensure_ascii=False)


def make_formatter(fmt: str) -> logging.Formatter:
    if fmt not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return JsonFormatter() if fmt == "json" else TextFormatter()


def _level_number(level: str) -> int:
    name = str(level).lower()
    if name not in LEVELS:
        raise ValueError(f"log level must be one of {', '.join(LEVELS)}, got {level!r}")
    return int(getattr(logging, name.upper()))


class _OmnistageHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Ours, so that configuring again replaces it instead of adding a second one."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self) -> Any:
        return sys.stderr  # the current stderr, even if it was replaced after configuration

    @stream.setter
    def stream(self, value: Any) -> None:
        pass


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    """Send the ``omnistage`` and ``uvicorn`` loggers' records at ``level`` or above to stderr
    in format ``fmt`` (``text`` or ``json``), and export both for stage processes. The root
    logger (third-party libraries) is not touched. Calling again replaces the configuration."""
    number = _level_number(level)
    formatter = make_formatter(fmt)
    for name in CONFIGURED_LOGGERS:
        logger = logging.getLogger(name)
        for old in [h for h in logger.handlers if isinstance(h, _OmnistageHandler)]:
            logger.removeHandler(old)
        handler = _OmnistageHandler()
        handler.setFormatter(formatter)
        logger.addHandler(handler)
        logger.setLevel(number)
        logger.propagate = False  # a root handler would print every line twice
    for name in ("uvicorn.error", "uvicorn.access", "uvicorn.asgi"):
        logging.getLogger(name).setLevel(logging.NOTSET)  # the "uvicorn" level decides
    os.environ[LEVEL_ENV] = str(level).lower()
    os.environ[FORMAT_ENV] = fmt


def configure_from_env() -> bool:
    """In a stage process: log as the process that configured logging does (its
    ``OMNISTAGE_LOG_*`` variables, inherited). Nothing is touched when neither is set (a library
    user who did not ask); bad values fall back to ``info`` / ``text``. Returns whether
    logging was configured."""
    level = os.environ.get(LEVEL_ENV, "").strip().lower()
    fmt = os.environ.get(FORMAT_ENV, "").strip().lower()
    if not level and not fmt:
        return False
    configure_logging(level if level in LEVELS else "info", fmt if fmt in FORMATS else "text")
    return True


def log_event(
    logger: logging.Logger, severity: int, event: str, message: str, /, **fields: Any
) -> None:
    """One log line at ``severity`` with ``event`` and ``fields`` as its structured fields
    (``None`` values are left out)."""
    if logger.isEnabledFor(severity):
        omni = {"event": event, **{k: v for k, v in fields.items() if v is not None}}
        logger.log(severity, message, extra={FIELDS_ATTR: omni})
