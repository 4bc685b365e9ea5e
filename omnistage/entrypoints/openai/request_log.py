"""One log line when a request arrives and one when it ends, with its id (unless the server
runs with ``--disable-log-requests``). Prompts are never logged, only their shape."""

from __future__ import annotations

import logging
import time
from typing import Any

from fastapi import Request

from omnistage.logs import log_event

logger = logging.getLogger("omnistage.requests")


class RequestLog:
    def __init__(self, request: Request, request_id: str, route: str) -> None:
        self.enabled = getattr(request.app.state, "log_requests", False)
        self.request_id = request_id
        self.route = route
        self.start = time.monotonic()

    def received(self, **fields: Any) -> None:
        if self.enabled:
            log_event(
                logger,
                logging.INFO,
                "request_received",
                f"request {self.request_id} received ({self.route})",
                request_id=self.request_id,
                route=self.route,
                **fields,
            )

    def finished(self, finish_reason: str | None, **fields: Any) -> None:
        if self.enabled:
            latency_ms = round((time.monotonic() - self.start) * 1e3, 3)
            log_event(
                logger,
                logging.INFO,
                "request_finished",
                f"request {self.request_id} finished: {finish_reason} in {latency_ms} ms",
                request_id=self.request_id,
                route=self.route,
                finish_reason=finish_reason,
                latency_ms=latency_ms,
                **fields,
            )
