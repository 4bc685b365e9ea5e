"""Every error class crosses a process boundary as data and comes back as itself, and ends
as the HTTP status the error table promises."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from omnistage import errors
from omnistage.entrypoints.serve.errors import ERROR_KINDS, register_exception_handlers
from omnistage.stage.messages import (
    ControlResult,
    WireError,
    decode_from_stage,
    encode,
)

EXAMPLES: list[Exception] = [
    errors.InvalidRequestError("max_tokens", "must be positive"),
    errors.RequestTooLargeError("body", "request body of 5000000 bytes or more"),
    errors.ContextLengthError("prompt", "600 tokens leave no room"),
    errors.ConflictError("session", "a weight update session is open"),
    errors.CheckpointError("bad.safetensors: header claims 9 bytes past the end"),
    errors.StageAsleepError(1),
    errors.StagePausedError(1),
    errors.StageBusyError(1, "sleeping"),
    errors.StageDeadError(1, "process 7 killed by SIGKILL"),
    errors.StageRestartingError(1, "process 7 killed by SIGKILL"),
    errors.StageStartupError("stage 1 failed to start: no config.json"),
    errors.StageInternalError("RuntimeError: shapes do not match"),
    errors.WeightsInvalidError(0),
    errors.NonFiniteOutputError("the model produced NaN or infinite logits"),
    errors.WeightTransferError("the weight transfer broke: connection closed by peer"),
    errors.SleepModeDisabledError(0),
    ValueError("unknown stage ids [7]"),
    TypeError("sleep() got an unexpected keyword argument 'colour'"),
    TimeoutError("drain did not finish; raise drain_timeout_s"),
]


def through_the_wire(exc: Exception, stage_id: int = 1) -> Exception:
    result = ControlResult(call_id=1, error=WireError.from_exception(exc))
    decoded = decode_from_stage(encode(result))
    assert isinstance(decoded, ControlResult) and decoded.error is not None
    return decoded.error.rebuild(stage_id)


def test_every_class_that_may_cross_has_an_example():
    assert {type(e).__name__ for e in EXAMPLES} == set(errors.ERROR_CLASSES) - {
        "OmnistageError",
        "StageError",
    }


@pytest.mark.parametrize("exc", EXAMPLES, ids=lambda e: type(e).__name__)
def test_errors_keep_class_message_and_field_across_the_boundary(exc):
    rebuilt = through_the_wire(exc)
    assert type(rebuilt) is type(exc)
    assert str(rebuilt) == str(exc)
    assert getattr(rebuilt, "field", None) == getattr(exc, "field", None)
    if isinstance(exc, errors.StageError):
        assert rebuilt.stage_id == 1  # type: ignore[attr-defined]


def test_an_unknown_class_becomes_an_internal_error_naming_it():
    class ShapeBug(Exception):
        pass

    rebuilt = through_the_wire(ShapeBug("mat1 and mat2 shapes cannot be multiplied"))
    assert isinstance(rebuilt, errors.StageInternalError)
    assert "ShapeBug" in str(rebuilt) and "mat1" in str(rebuilt)


def _status_of(exc: Exception) -> int:
    app = FastAPI()
    register_exception_handlers(app)

    @app.get("/raise")
    async def raise_it() -> None:
        raise exc

    return TestClient(app, raise_server_exceptions=False).get("/raise").status_code


def _promised_status(exc: Exception) -> int:
    for cls in type(exc).__mro__:
        if cls in ERROR_KINDS:
            return ERROR_KINDS[cls].status_code
    return 500


@pytest.mark.parametrize("exc", EXAMPLES, ids=lambda e: type(e).__name__)
def test_a_rebuilt_error_ends_as_the_status_the_table_promises(exc):
    rebuilt = through_the_wire(exc)
    assert _status_of(rebuilt) == _promised_status(exc) == _status_of(exc)


def test_checkpoint_errors_are_client_errors_wherever_they_are_raised():
    assert _status_of(through_the_wire(errors.CheckpointError("not safetensors"))) == 400
