"""The exception hierarchy, and how an exception crosses a process boundary as data.

The HTTP layer maps these classes to status codes in one place
(``omnistage.entrypoints.serve.errors``). A stage process sends an exception as its class
name, message and offending field (``error_fields``); the engine client rebuilds the same
class from the ``ERROR_CLASSES`` table (``rebuild_error``), so a ``CheckpointError`` raised in
a stage is answered exactly as the same error raised in the API process.
"""

from __future__ import annotations


class OmnistageError(Exception):
    """Base class of omnistage's own errors."""


class InvalidRequestError(OmnistageError, ValueError):
    """A request parameter is invalid (HTTP 400). ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message

    def under(self, prefix: str) -> InvalidRequestError:
        """The same error with its field named under ``prefix`` (``sampling_params.top_p``)."""
        return type(self)(f"{prefix}.{self.field}", getattr(self, "reason", str(self)))


class RequestTooLargeError(InvalidRequestError):
    """A request body exceeds a configured bound (HTTP 413)."""


class ContextLengthError(InvalidRequestError):
    """A prompt too long for the model's ``max_model_len`` (HTTP 400, as vLLM and OpenAI
    answer it: ``code`` ``context_length_exceeded``)."""


class ModelNotFoundError(OmnistageError):
    """A request names a model the server does not serve (HTTP 404, in vLLM's shape)."""

    field = "model"

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.")


class ResourceNotFoundError(InvalidRequestError):
    """A request names a resource the server does not hold, e.g. a video job (HTTP 404)."""


class CapacityError(InvalidRequestError):
    """A bounded resource is full with work still under way (HTTP 429); ``field`` names what
    the request wanted, the message the setting that bounds it."""


class ConflictError(OmnistageError):
    """The request collides with state another caller holds (HTTP 409): a weight update
    session someone else opened, a transfer still in flight. Not a bad value — the same
    request may succeed once that state is gone — so not an ``InvalidRequestError``;
    ``field`` names what the caller must send (or wait for) to get through."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class CheckpointError(OmnistageError, ValueError):
    """A checkpoint is missing, malformed, or does not fit the model (HTTP 400)."""


class StageError(OmnistageError):
    """Base of the errors that concern one stage; ``stage_id`` names it. ``retry_after``:
    the stage comes back by itself (a restart, an automatic wake), so a client may retry
    (HTTP ``Retry-After``)."""

    stage_id: int = -1
    retry_after: bool = False


class StageAsleepError(StageError):
    """A request needs stages that are asleep (HTTP 503); ``stage_ids`` names every one.
    ``retry_after`` when the server wakes them by itself (``--auto-wake``)."""

    def __init__(
        self,
        stage_id: int | list[int],
        message: str | None = None,
        *,
        retry_after: bool = False,
    ) -> None:
        ids = [stage_id] if isinstance(stage_id, int) else list(stage_id)
        if message is None:
            which = f"stage {ids[0]} is" if len(ids) == 1 else f"stages {ids} are"
            message = (
                f'{which} asleep; wake with POST /v1/omni/wakeup {{"stage_ids": {ids}}} and retry'
            )
        super().__init__(message)
        self.stage_id = ids[0]
        self.stage_ids = ids
        self.retry_after = retry_after


class StagePausedError(StageError):
    """A stage is paused and not admitting requests (HTTP 503)."""

    def __init__(self, stage_id: int, waited_s: float | None = None) -> None:
        waited = "" if waited_s is None else (
            f" (a request waits at most {waited_s:g} s for it: --paused-request-timeout-s)"
        )  # fmt: skip
        super().__init__(
            f"stage {stage_id} is paused; resume it with POST /v1/omni/resume "
            f'{{"stage_ids": [{stage_id}]}}{waited}'
        )
        self.stage_id = stage_id


class StageBusyError(StageError):
    """A conflicting sleep/wake transition is already running on the stage (HTTP 409)."""

    def __init__(self, stage_id: int, state: str) -> None:
        super().__init__(f"stage {stage_id} is busy ({state}); retry when the transition ends")
        self.stage_id = stage_id
        self.state = state


class RequestAbortedError(StageError):
    """A request ended by an abort (``/v1/omni/abort``, a sleep with mode ``abort``) before it
    made what a route answers with (HTTP 503; the same request may succeed again)."""

    retry_after = True

    def __init__(self, stage_id: int, message: str) -> None:
        super().__init__(message)
        self.stage_id = stage_id


class StageDeadError(StageError):
    """The stage process died and is not coming back (HTTP 503)."""

    def __init__(self, stage_id: int, detail: str = "") -> None:
        super().__init__(f"stage {stage_id} process is dead" + (f": {detail}" if detail else ""))
        self.stage_id = stage_id


class StageRestartingError(StageDeadError):
    """The stage process died and the server is restarting it (HTTP 503 with Retry-After)."""

    retry_after = True

    def __init__(self, stage_id: int, detail: str = "") -> None:
        StageError.__init__(
            self,
            f"stage {stage_id} process is dead"
            + (f" ({detail})" if detail else "")
            + "; the server is restarting it, retry shortly",
        )
        self.stage_id = stage_id


class StageStartupError(StageError):
    """A stage process failed to start or did not report ready in time."""


class StageInternalError(StageError):
    """An unexpected error inside a stage, of a class the engine client does not know
    (HTTP 500: a bug, reported with the stage's own type name and message)."""


class WeightsInvalidError(StageError):
    """The stage's weights were discarded and not reloaded; it refuses to generate (HTTP 503)."""

    def __init__(self, stage_id: int) -> None:
        super().__init__(
            f"stage {stage_id} has no valid weights: they were discarded by sleep(level=2) and "
            "woken with reload=false; call update_weights (POST /v1/omni/update_weights) or wake "
            "with reload=true first"
        )
        self.stage_id = stage_id


class WeightTransferError(StageError):
    """A weight transfer from a trainer broke (the trainer went away, the group timed out);
    the previous weights keep serving (HTTP 502)."""


class NonFiniteOutputError(StageError):
    """The model produced NaN or infinite logits for a request (the request fails, HTTP 500
    in a reply or an in-band error in a stream; the stage keeps serving)."""


class SleepModeDisabledError(StageError):
    """Sleep or wake was asked of a stage started without sleep mode (HTTP 501)."""

    def __init__(self, stage_id: int) -> None:
        super().__init__(
            f"stage {stage_id} was started without sleep mode; restart with --enable-sleep-mode "
            "(enable_sleep_mode: true) to use sleep"
        )
        self.stage_id = stage_id


# Every class that may cross a process boundary, by the name it travels under. Builtins are
# here because engines raise them for programming errors the caller can act on.
ERROR_CLASSES: dict[str, type[Exception]] = {
    cls.__name__: cls
    for cls in (
        OmnistageError,
        InvalidRequestError,
        RequestTooLargeError,
        ContextLengthError,
        ConflictError,
        CheckpointError,
        StageError,
        StageAsleepError,
        StagePausedError,
        StageBusyError,
        StageDeadError,
        StageRestartingError,
        StageStartupError,
        StageInternalError,
        WeightsInvalidError,
        NonFiniteOutputError,
        WeightTransferError,
        SleepModeDisabledError,
        ValueError,
        TypeError,
        TimeoutError,
    )
}


def error_fields(exc: BaseException) -> tuple[str, str, str | None]:
    """``(type name, message, field)``: what an exception sends across a process boundary."""
    return type(exc).__name__, str(exc), getattr(exc, "field", None)


def rebuild_error(stage_id: int, type_name: str, message: str, field: str | None) -> Exception:
    """The exception a stage sent, rebuilt as the same class with the same message.

    The class's ``__init__`` is bypassed (its arguments did not travel); ``field`` and
    ``stage_id`` are set as attributes. An unknown class becomes ``StageInternalError``.
    """
    cls = ERROR_CLASSES.get(type_name)
    if cls is None:
        return _with_stage(
            StageInternalError(f"stage {stage_id}: {type_name}: {message}"), stage_id
        )
    exc = cls.__new__(cls)
    Exception.__init__(exc, message)
    if field is not None:
        exc.field = field  # type: ignore[attr-defined]
    return _with_stage(exc, stage_id)


def _with_stage(exc: Exception, stage_id: int) -> Exception:
    if isinstance(exc, StageError):
        exc.stage_id = stage_id
    return exc
