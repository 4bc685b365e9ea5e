"""The last control operations the engine client reported — sleeps, wakes, weight updates —
whatever started them: a control route, ``omnistage ctl``, ``--auto-wake`` or
``--idle-sleep-s``. ``GET /v1/omni/acks`` serves them (the console's ACK table at ``/ui``).

The engine client tells its listeners after every operation (``add_control_listener``); the
journal keeps the newest ``JOURNAL_LENGTH`` of them, each with its ACKs as they were answered
(one per stage and rank), in memory only.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel

JOURNAL_LENGTH = 64


class ControlJournal:
    def __init__(self, length: int = JOURNAL_LENGTH) -> None:
        self._entries: deque[dict[str, Any]] = deque(maxlen=length)
        self._seq = itertools.count(1)

    def record(self, operation: str, acks: Sequence[Mapping[str, Any]]) -> None:
        """A control listener: ``operation`` (``sleep``, ``wake_up``, ...) and its ACKs."""
        self._entries.append(
            {
                "seq": next(self._seq),
                "time": round(time.time(), 3),
                "operation": operation,
                "acks": [dict(ack) for ack in acks],
            }
        )

    @property
    def last_seq(self) -> int:
        """The newest operation's ``seq`` (0: none yet); a client that saw a greater one talks
        to a restarted server."""
        entries = list(self._entries)
        return int(entries[-1]["seq"]) if entries else 0

    def entries(self, limit: int = JOURNAL_LENGTH, after: int = 0) -> list[dict[str, Any]]:
        """The newest ``limit`` operations with ``seq`` above ``after``, oldest first."""
        newer = [entry for entry in list(self._entries) if entry["seq"] > after]
        return newer[-limit:] if limit > 0 else []


class OmniAcksResponse(BaseModel):
    """Reply of ``GET /v1/omni/acks``: the last control operations, oldest first, each
    ``{"seq", "time" (Unix seconds), "operation", "acks"}``, and the newest ``seq`` there is."""

    operations: list[dict[str, Any]]
    last_seq: int = 0
