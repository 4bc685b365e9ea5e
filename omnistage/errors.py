"""The exception hierarchy. The HTTP layer maps these to status codes in one place."""

from __future__ import annotations


class OmnistageError(Exception):
    """Base class of omnistage's own errors."""


class InvalidRequestError(OmnistageError, ValueError):
    """A request parameter is invalid (HTTP 400). ``field`` names it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class StageAsleepError(OmnistageError):
    """A request needs a stage that is asleep (HTTP 503 with Retry-After)."""

    def __init__(self, stage_id: int, message: str | None = None) -> None:
        super().__init__(
            message
            or f"stage {stage_id} is asleep; wake it with POST /v1/omni/wakeup "
            f'{{"stage_ids": [{stage_id}]}} and retry'
        )
        self.stage_id = stage_id


class StagePausedError(OmnistageError):
    """A stage is paused and not admitting requests (HTTP 503 with Retry-After)."""

    def __init__(self, stage_id: int) -> None:
        super().__init__(
            f"stage {stage_id} is paused; resume it with POST /v1/omni/resume "
            f'{{"stage_ids": [{stage_id}]}}'
        )
        self.stage_id = stage_id


class StageBusyError(OmnistageError):
    """A conflicting sleep/wake transition is already running on the stage (HTTP 409)."""

    def __init__(self, stage_id: int, state: str) -> None:
        super().__init__(f"stage {stage_id} is busy ({state}); retry when the transition ends")
        self.stage_id = stage_id
        self.state = state


class StageDeadError(OmnistageError):
    """The stage process died (HTTP 503)."""

    def __init__(self, stage_id: int, detail: str = "") -> None:
        super().__init__(f"stage {stage_id} process is dead" + (f": {detail}" if detail else ""))
        self.stage_id = stage_id


class WeightsInvalidError(OmnistageError):
    """The stage's weights were discarded and not reloaded; it refuses to generate (HTTP 503)."""

    def __init__(self, stage_id: int) -> None:
        super().__init__(
            f"stage {stage_id} has no valid weights: they were discarded by sleep(level=2) and "
            "woken with reload=false; call update_weights (POST /v1/omni/update_weights) or wake "
            "with reload=true first"
        )
        self.stage_id = stage_id


class SleepModeDisabledError(OmnistageError):
    """Sleep or wake was asked of a stage started without sleep mode (HTTP 501)."""

    def __init__(self, stage_id: int) -> None:
        super().__init__(
            f"stage {stage_id} was started without sleep mode; restart with --enable-sleep-mode "
            "(enable_sleep_mode: true) to use sleep"
        )
        self.stage_id = stage_id
