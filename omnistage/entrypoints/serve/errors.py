"""Exceptions to HTTP responses, in one place.

Every error reply has the OpenAI shape ``{"error": {"message", "type", "code", "param"}}`` plus
a top-level ``"detail"`` string (what FastAPI and vLLM-Omni clients read). ``code`` is a stable
machine-readable name (``stage_asleep``, ``stage_busy``, ``context_length_exceeded``, ...) —
except for a model the server does not serve, answered exactly as vLLM does (404, ``type``
``NotFoundError``, ``code`` 404); ``param`` names the offending field when there is one.

Bad input is 400, never 500: request validation (body, query) and malformed JSON are 400 with
the field named and pydantic's type code (``body.stage_ids: Input should be a valid list
[type=list_type]``) — 400 rather than FastAPI's
422 because that is what OpenAI-compatible clients expect. ``ValueError`` is 400 too: engine
clients raise it for unknown stage ids, naming the valid range. Anything unexpected is a JSON
500 naming the exception (the error surfaces; it is not swallowed).
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from omnistage.errors import (
    CapacityError,
    CheckpointError,
    ConflictError,
    ContextLengthError,
    InvalidRequestError,
    ModelNotFoundError,
    NonFiniteOutputError,
    RequestAbortedError,
    RequestTooLargeError,
    ResourceNotFoundError,
    SleepModeDisabledError,
    StageAsleepError,
    StageBusyError,
    StageDeadError,
    StageInternalError,
    StagePausedError,
    StageRestartingError,
    StageStartupError,
    WeightsInvalidError,
    WeightTransferError,
)


@dataclass(frozen=True)
class ErrorKind:
    """How one exception class is answered. ``retry_after``: the 503 carries ``Retry-After``
    (a stage asleep, paused or restarting, as SPEC and vLLM-Omni's clients expect); any other
    error says so itself with its ``retry_after``."""

    status_code: int
    type: str
    code: str | int
    retry_after: bool = False


_UNAVAILABLE = "service_unavailable_error"

# Looked up along the exception's MRO, so the most specific class wins
# (InvalidRequestError before ValueError).
ERROR_KINDS: dict[type[Exception], ErrorKind] = {
    RequestTooLargeError: ErrorKind(413, "invalid_request_error", "request_too_large"),
    ResourceNotFoundError: ErrorKind(404, "invalid_request_error", "not_found"),
    CapacityError: ErrorKind(429, "rate_limit_error", "too_many_requests"),
    ContextLengthError: ErrorKind(400, "invalid_request_error", "context_length_exceeded"),
    # vLLM's answer, word for word: its clients look for the type and the numeric code.
    ModelNotFoundError: ErrorKind(404, "NotFoundError", 404),
    InvalidRequestError: ErrorKind(400, "invalid_request_error", "invalid_request"),
    CheckpointError: ErrorKind(400, "invalid_request_error", "invalid_checkpoint"),
    ValueError: ErrorKind(400, "invalid_request_error", "invalid_value"),
    TypeError: ErrorKind(400, "invalid_request_error", "invalid_type"),
    StageBusyError: ErrorKind(409, "conflict_error", "stage_busy"),
    ConflictError: ErrorKind(409, "conflict_error", "conflict"),
    StageAsleepError: ErrorKind(503, _UNAVAILABLE, "stage_asleep", retry_after=True),
    RequestAbortedError: ErrorKind(503, _UNAVAILABLE, "request_aborted", retry_after=True),
    StagePausedError: ErrorKind(503, _UNAVAILABLE, "stage_paused", retry_after=True),
    StageRestartingError: ErrorKind(503, _UNAVAILABLE, "stage_restarting", retry_after=True),
    StageDeadError: ErrorKind(503, _UNAVAILABLE, "stage_dead"),
    StageStartupError: ErrorKind(503, _UNAVAILABLE, "stage_startup_failed"),
    WeightsInvalidError: ErrorKind(503, _UNAVAILABLE, "weights_invalid"),
    SleepModeDisabledError: ErrorKind(501, "not_implemented_error", "sleep_mode_disabled"),
    TimeoutError: ErrorKind(504, "timeout_error", "timeout"),
    NonFiniteOutputError: ErrorKind(500, "server_error", "non_finite_output"),
    WeightTransferError: ErrorKind(502, "server_error", "weight_transfer_failed"),
    StageInternalError: ErrorKind(500, "server_error", "stage_internal_error"),
}


def error_response(
    status_code: int,
    message: str,
    *,
    type: str,
    code: str | int | None = None,
    param: str | None = None,
    headers: dict[str, str] | None = None,
) -> JSONResponse:
    """A JSON error reply in the server's one error shape."""
    body = {
        "error": {"message": message, "type": type, "code": code, "param": param},
        "detail": message,
    }
    return JSONResponse(status_code=status_code, content=body, headers=headers)


def error_status(exc: BaseException) -> tuple[int, str | int]:
    """The HTTP status and ``code`` an exception is answered with."""
    kind = _kind_of(exc) or ErrorKind(500, "server_error", "internal_error")
    return kind.status_code, kind.code


def error_body(exc: BaseException) -> dict[str, Any]:
    """``{"error": {...}}`` of an exception, as its HTTP reply would carry it: what a stream
    sends in-band when a request fails after its first event."""
    kind = _kind_of(exc) or ErrorKind(500, "server_error", "internal_error")
    param = getattr(exc, "field", None)
    return {
        "error": {
            "message": _message_of(exc),
            "type": kind.type,
            "code": kind.code,
            "param": param if isinstance(param, str) else None,
        }
    }


def _kind_of(exc: BaseException) -> ErrorKind | None:
    for cls in type(exc).__mro__:
        if cls in ERROR_KINDS:
            return ERROR_KINDS[cls]
    return None


def _message_of(exc: BaseException) -> str:
    if isinstance(exc, SleepModeDisabledError):
        # Clients of both routes look for the operation's name in the detail.
        return f"Engine does not support sleep / wake_up: {exc}"
    return str(exc) or type(exc).__name__


def _field_path(loc: tuple[Any, ...] | list[Any]) -> str:
    return ".".join(str(part) for part in loc)


def _validation_message(errors: list[dict[str, Any]]) -> str:
    parts = []
    for error in errors:
        if error.get("type") == "json_invalid":
            reason = (error.get("ctx") or {}).get("error", "JSON decode error")
            parts.append(f"body: malformed JSON ({reason})")
        elif error.get("type") == "extra_forbidden":
            parts.append(
                f"{_field_path(error.get('loc', ()))}: not supported by omnistage (a field "
                "it does not implement is refused, never ignored)"
            )
        else:  # pydantic's type code too, as vLLM's handler shows it (clients match on it)
            where = _own_field(error) or _field_path(error.get("loc", ()))
            parts.append(f"{where}: {error.get('msg')} [type={error.get('type')}]")
    return "; ".join(parts)


def _own_field(error: dict[str, Any]) -> str | None:
    """The field a model validator named (``protocol.field_error``), under the error's own
    location (a batch's conversation, a message)."""
    field = (error.get("ctx") or {}).get("field")
    if not isinstance(field, str):
        return None
    loc = [str(part) for part in error.get("loc", ())[1:]]
    return ".".join([*loc, field])


def _validation_param(errors: list[dict[str, Any]]) -> str | None:
    """The first offending field without its location prefix (``body.stage_ids`` → ``stage_ids``)."""
    for error in errors:
        if _own_field(error):  # a check across fields names the one at fault
            return _own_field(error)
        loc = [part for part in error.get("loc", ()) if not isinstance(part, int)]
        if len(loc) > 1 and error.get("type") != "json_invalid":
            return _field_path(loc[1:])
    return None


def _status_code_name(status: int) -> str:
    """``404`` → ``not_found``; ``http_599`` for codes without a standard phrase."""
    try:
        return HTTPStatus(status).phrase.lower().replace(" ", "_").replace("-", "_")
    except ValueError:
        return f"http_{status}"


def register_exception_handlers(app: FastAPI, *, retry_after_s: int = 1) -> None:
    """Install the handlers on ``app``; ``retry_after_s`` is the ``Retry-After`` of a 503 for
    a stage that is asleep, paused or restarting."""

    async def on_known_error(request: Request, exc: Exception) -> JSONResponse:
        kind = _kind_of(exc)
        if kind is None:  # only reachable if ERROR_KINDS and the registration disagree
            return await on_unexpected_error(request, exc)
        return error_response(
            kind.status_code,
            _message_of(exc),
            type=kind.type,
            code=kind.code,
            param=getattr(exc, "field", None),
            headers={"Retry-After": str(retry_after_s)}
            if kind.retry_after or getattr(exc, "retry_after", False)
            else None,
        )

    async def on_validation_error(request: Request, exc: Exception) -> JSONResponse:
        errors = list(exc.errors()) if isinstance(exc, RequestValidationError) else []
        return error_response(
            400,
            _validation_message(errors) or str(exc),
            type="invalid_request_error",
            code="invalid_request",
            param=_validation_param(errors),
        )

    async def on_http_exception(request: Request, exc: Exception) -> JSONResponse:
        if not isinstance(exc, StarletteHTTPException):  # registration guarantees it is
            return await on_unexpected_error(request, exc)
        status = exc.status_code
        error_type = {401: "authentication_error", 501: "not_implemented_error"}.get(
            status, "invalid_request_error" if status < 500 else "server_error"
        )
        return error_response(
            status,
            str(exc.detail),
            type=error_type,
            code=_status_code_name(status),
            headers=dict(exc.headers) if exc.headers else None,
        )

    async def on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        return error_response(
            500, f"{type(exc).__name__}: {exc}", type="server_error", code="internal_error"
        )

    for exc_class in ERROR_KINDS:
        app.add_exception_handler(exc_class, on_known_error)
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(StarletteHTTPException, on_http_exception)
    app.add_exception_handler(Exception, on_unexpected_error)
