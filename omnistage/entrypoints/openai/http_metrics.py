"""Count every HTTP response by method, route template and status code — 4xx and 5xx
included, and the 413s the body limit sends before any route runs.

ASGI middleware, the outermost one. The route is the template (``/v1/omni/sleep``), never
the raw path, so a scan of random paths cannot grow the series: unknown paths count as
``other``.
"""

from __future__ import annotations

from starlette.routing import Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send


class HttpMetrics:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500  # a response that never started is a server error

        async def tracked(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        finally:
            metrics = getattr(scope["app"].state, "metrics", None)
            if metrics is not None:
                metrics.observe_http(scope.get("method", ""), _route(scope), status)


def _route(scope: Scope) -> str:
    route = scope.get("route")
    if route is not None and hasattr(route, "path"):
        return str(route.path)
    for candidate in getattr(scope["app"], "routes", []):
        match, _ = candidate.matches(scope)
        if match == Match.FULL and hasattr(candidate, "path"):
            return str(candidate.path)
    return "other"
