"""API-key checks for the HTTP server.

Two keys, both read from ``request.app.state`` so the app factory decides them at start-up:

- ``app.state.api_key`` (``--api-key``) guards every route except ``/health`` and ``/metrics``:
  data routers include :func:`require_api_key` as a dependency.
- ``app.state.control_api_key`` (``--control-api-key`` or ``OMNISTAGE_CONTROL_API_KEY``) guards
  the control routes (``/v1/omni/*`` and vLLM's ``/sleep`` family) through
  :func:`require_control_key`. Without it the control routes demand ``api_key``; with it they
  demand the control key only (a request carries one ``Authorization`` header).

Keys travel as ``Authorization: Bearer KEY`` and are compared in constant time. A missing or
wrong key is 401 with ``WWW-Authenticate: Bearer``; the reply never says which key was expected.
"""

from __future__ import annotations

import hmac
import os
from collections.abc import Mapping

from fastapi import HTTPException, Request

from omnistage.config import ConfigError

API_KEY_ENV = "OMNISTAGE_API_KEY"
CONTROL_API_KEY_ENV = "OMNISTAGE_CONTROL_API_KEY"


def key_from_env(name: str, environ: Mapping[str, str] = os.environ) -> str | None:
    """``$name``, or None when it is not set. Set but empty or blank (or with whitespace around
    the key) is refused as the flags are: an operator who exported the variable meant a key,
    and an empty one must not quietly serve without any."""
    value = environ.get(name)
    if value is None:
        return None
    if not value.strip() or value.strip() != value:
        raise ConfigError(
            f"${name} is set but {'empty' if not value.strip() else 'has surrounding whitespace'}"
            f": give it a key, or unset it to serve without one"
        )
    return value


def resolve_control_api_key(
    cli_value: str | None, environ: Mapping[str, str] = os.environ
) -> str | None:
    """The control key: the command-line value, else ``$OMNISTAGE_CONTROL_API_KEY``, else None
    (``ConfigError`` for a variable that is set but blank)."""
    return cli_value or key_from_env(CONTROL_API_KEY_ENV, environ)


def bearer_token(request: Request) -> str | None:
    """The token of an ``Authorization: Bearer TOKEN`` header, or None."""
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def _demand_key(request: Request, expected: str | None, what: str) -> None:
    if not expected:
        return
    token = bearer_token(request)
    if token is None or not hmac.compare_digest(token.encode(), expected.encode()):
        raise HTTPException(
            status_code=401,
            detail=f"Missing or invalid {what}: send 'Authorization: Bearer <key>'",
            headers={"WWW-Authenticate": "Bearer"},
        )


async def require_api_key(request: Request) -> None:
    """Dependency: 401 unless the request carries ``app.state.api_key`` (when one is set)."""
    _demand_key(request, getattr(request.app.state, "api_key", None), "API key")


async def require_control_key(request: Request) -> None:
    """Dependency: 401 unless the request carries the control key (or, without one, the API key)."""
    state = request.app.state
    control_key = getattr(state, "control_api_key", None)
    if control_key:
        _demand_key(request, control_key, "control API key")
    else:
        _demand_key(request, getattr(state, "api_key", None), "API key")
