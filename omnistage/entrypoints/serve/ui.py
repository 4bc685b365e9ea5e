"""The operator console and playground at ``/ui`` (on by default, ``--no-ui`` turns it off).

The page is static files shipped in the package (``ui_static/``: HTML, CSS and ES modules;
no build step, nothing loaded from another host). The shell loads without a key — the HTML,
the scripts and the control vocabulary are the same on every server — but it holds no data:
every call the page makes for data goes to the server's own routes with the key the user
typed (``Authorization: Bearer``), so behind ``--api-key`` a visitor without it sees a login
prompt and nothing else. See ``docs/ui.md``.

The documents are served with a Content-Security-Policy that allows scripts and styles from
this server only, network calls to this origin only, and media from ``data:``/``blob:`` URLs
(the replies' images and speech): a reply's text cannot run as script, and a key typed into
the page can only travel to this server.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from starlette.staticfiles import StaticFiles

from omnistage.stage.vocabulary import (
    ACK_STATUSES,
    DEFAULT_SLEEP_LEVEL,
    DEFAULT_SLEEP_MODE,
    MEMORY_TAGS,
    SLEEP_LEVELS,
    SLEEP_MODES,
)

STATIC = Path(__file__).with_name("ui_static")
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; "
    "media-src 'self' data: blob:; connect-src 'self'; base-uri 'none'; form-action 'none'; "
    "frame-ancestors 'none'"
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    # Revalidated on every load (ETag / Last-Modified): an upgraded server serves its own page.
    "Cache-Control": "no-cache",
}

router = APIRouter(include_in_schema=False)


@router.get("/ui")
async def ui_root() -> RedirectResponse:
    # Relative, so that the page also works under a proxy's path prefix; the page's own
    # links (static/..., ../v1/...) are relative to /ui/.
    return RedirectResponse("ui/", status_code=307)


@router.get("/ui/")
async def ui_index() -> FileResponse:
    return FileResponse(STATIC / "index.html", headers=HEADERS)


@router.get("/ui/vocabulary.json")
async def ui_vocabulary() -> Any:
    """The control vocabulary the page's forms offer (``omnistage.stage.vocabulary``): the
    page spells no level, mode or tag of its own, and sends what the user chose as it is —
    the server's checks answer a bad value (400)."""
    return {
        "levels": list(SLEEP_LEVELS),
        "default_level": DEFAULT_SLEEP_LEVEL,
        "modes": list(SLEEP_MODES),
        "default_mode": DEFAULT_SLEEP_MODE,
        "tags": list(MEMORY_TAGS),
        "ack_statuses": list(ACK_STATUSES),
    }


class _Static(StaticFiles):
    def file_response(self, *args: Any, **kwargs: Any) -> Any:
        response = super().file_response(*args, **kwargs)
        response.headers.update(HEADERS)
        return response


def mount_ui(app: FastAPI) -> None:
    """Serve the page at ``/ui`` (its files under ``/ui/static/``)."""
    app.include_router(router)
    app.mount("/ui/static", _Static(directory=STATIC), name="ui-static")
