"""What every stage engine shares: pause modes, the one sleep/wake algorithm over the engine's
worker, weight updates and syncs, and the status every kind reports.

A kind's engine (``ARStageEngine``, the step-scheduled ``JobEngine``) fills in what differs:
how its requests are paused (``_pause_requests``) and resumed, when they have drained, and
what request state lives in memory that a sleep releases (``_drop_memory_state``: the AR
KV cache's block bookkeeping). ``resumes_after_wake`` says whether a woken stage schedules
again by itself or waits for ``resume()`` (an AR stage: its caller decides when generation
restarts; see ``docs/control-plane.md``).

- ``pause(mode)``: "abort" ends every request with finish_reason "abort"; "wait" lets the
  requests already here run to completion while new ones queue until ``resume()``; "keep"
  holds every request where it is and they continue after ``resume()``.
- ``sleep(level, mode, tags)`` pauses with ``mode`` (unless already paused), lets the kind
  drop state that lives in the memory about to go, and releases the worker's arena. Level 0
  pauses only. With "wait" the requests must have drained first: the caller drives
  ``step()`` until ``is_drained()`` (bounded by ``drain_timeout_s``).
- ``wake_up(tags, reload)`` maps memory back (level 2 reloads the weights in place unless
  ``reload`` is False) and answers whether the stage still waits for a resume.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Generic, Protocol, TypeVar

import torch

from omnistage.config import StageConfig
from omnistage.errors import SleepModeDisabledError
from omnistage.memory import Arena
from omnistage.stage.control import Ack, Pause, Sleep, WakeUp, make_ack
from omnistage.stage.sleep_control import SleepController
from omnistage.stage.vocabulary import check_tags
from omnistage.stage.weights.sync import WeightSync


class StageWorker(Protocol):
    """What a rank owns (``omnistage.stage.worker.ArenaWorker``, or every rank of a
    tensor-parallel stage behind one object)."""

    @property
    def arena(self) -> Arena: ...
    @property
    def sleep_control(self) -> SleepController: ...

    def weight_targets(self) -> dict[str, torch.Tensor]: ...
    def sleep(self, level: int, tags: Sequence[str] | None, **metadata: Any) -> Ack: ...
    def wake_up(self, tags: Sequence[str] | None, reload: bool) -> Ack: ...
    def update_weights(self, path: str | Path, check_finite: bool = True) -> Ack: ...
    def adopt_history(self, sources: list[str], *, load: bool) -> None: ...
    def close(self) -> None: ...


W = TypeVar("W", bound=StageWorker)


class StageEngineBase(Generic[W]):
    """Control shared by every kind's engine; see the module docstring."""

    resumes_after_wake: ClassVar[bool] = False

    def __init__(self, config: StageConfig, worker: W) -> None:
        self.config = config
        self.stage_id = config.stage_id
        self.worker = worker
        self._pause_mode: str | None = None
        self._asleep_at_level0 = False
        self.weight_version: str | None = None  # set by a trainer's weight sync
        self.weight_sync = WeightSync(
            self.stage_id, worker.weight_targets, self._apply_synced, worker.arena.device,
            shared=True if config.tensor_parallel_size > 1 else None,  # the ranks read it
        )  # fmt: skip

    # -- the kind's part ------------------------------------------------------------------

    def _pause_requests(self, mode: str) -> tuple[int, int]:
        """Apply ``mode`` to the requests here; returns ``(aborted, preempted)``."""
        raise NotImplementedError

    def _resume_requests(self) -> None:
        """Let held requests be scheduled again."""

    def is_drained(self) -> bool:
        """True once every request that was here at ``pause("wait")`` has finished."""
        raise NotImplementedError

    def drain_holders(self) -> list[str]:
        """The requests ``is_drained`` still waits for (a ``wait`` sleep's error names them)."""
        raise NotImplementedError

    def _drop_memory_state(self) -> int:
        """Forget request state kept in the memory a sleep releases; returns the requests
        preempted for it (they recompute after wake)."""
        return 0

    def _after_wake(self, ack: Ack) -> None:
        """The memory in ``ack.metadata.tags`` is back (contents reloaded or not)."""

    def _after_weights_changed(self) -> None:
        """The weights changed in place (an update or a trainer's sync)."""

    def has_runnable_work(self) -> bool:
        """Whether ``step()`` would make progress now even if it answers nothing (a job
        mid-way): the stage loop then does not wait before the next step."""
        return False

    # -- shared state ---------------------------------------------------------------------

    @property
    def arena(self) -> Arena:
        return self.worker.arena

    @property
    def sleep_control(self) -> SleepController:
        return self.worker.sleep_control

    @property
    def is_paused(self) -> bool:
        return self._pause_mode is not None

    @property
    def pause_mode(self) -> str | None:
        return self._pause_mode

    def is_sleeping(self) -> bool:
        return self.sleep_control.is_sleeping or self._asleep_at_level0

    # -- pause / resume -------------------------------------------------------------------

    def pause(self, mode: str = "abort") -> int:
        """Stop scheduling (see the module docstring); returns the number of aborted requests."""
        aborted, _ = self._pause(Pause(mode=mode).mode)
        return aborted

    def _pause(self, mode: str) -> tuple[int, int]:
        counts = self._pause_requests(mode)
        self._pause_mode = mode
        return counts

    def resume(self) -> None:
        self._pause_mode = None
        self._resume_requests()

    # -- sleep / wake / weights -----------------------------------------------------------

    def _require_sleep_mode(self) -> None:
        if not self.config.enable_sleep_mode:
            raise SleepModeDisabledError(self.stage_id)

    def sleep(self, level: int = 2, mode: str = "abort", tags: Sequence[str] | None = None) -> Ack:
        """Pause with ``mode`` (unless paused), then release memory for ``level``.

        Mode "wait" raises ``RuntimeError`` while requests are still draining: the caller
        drives ``step()`` until ``is_drained()`` (bounded by ``drain_timeout_s``) and retries.
        """
        op = Sleep(level=level, mode=mode, tags=None if tags is None else list(tags))
        self._require_sleep_mode()
        chosen = check_tags(
            op.tags, self.arena.tags
        )  # before pausing: a refused sleep aborts nothing
        aborted = preempted = 0
        if self._pause_mode is None:
            aborted, preempted = self._pause(op.mode)
        if self._pause_mode == "wait" and not self.is_drained():
            raise RuntimeError(
                f"stage {self.stage_id}: requests are still draining; call step() until "
                "is_drained() (bounded by drain_timeout_s), then sleep again"
            )
        if op.level >= 1:
            preempted += self._drop_memory_state()
        ack = self.worker.sleep(
            op.level, chosen, mode=self._pause_mode, aborted=aborted, preempted=preempted
        )
        if op.level == 0:
            self._asleep_at_level0 = True
        ack.metadata.paused = True
        return ack

    def wake_up(
        self, tags: Sequence[str] | None = None, reload: bool = True, resume: bool = False
    ) -> Ack:
        """Map memory back (reloading discarded weights unless ``reload`` is False); a stage
        kind that ``resumes_after_wake``, or a wake asked to ``resume``, schedules again once
        nothing is asleep."""
        op = WakeUp(tags=None if tags is None else list(tags), reload=reload, resume=resume)
        self._require_sleep_mode()
        chosen = check_tags(op.tags, self.arena.tags)
        if self._asleep_at_level0 and not self.sleep_control.is_sleeping:
            ack = make_ack(self.stage_id, level=0, weights_valid=self.sleep_control.weights_valid)
        else:
            ack = self.worker.wake_up(chosen, op.reload)
        if ack.status == "SUCCESS" and not self.sleep_control.is_sleeping:
            self._asleep_at_level0 = False
            if self.resumes_after_wake or op.resume:
                self.resume()
        if ack.status != "ERROR":
            self._after_wake(ack)
        ack.metadata.paused = self.is_paused
        return ack

    def update_weights(self, path: str | Path, check_finite: bool = True) -> Ack:
        """Load a safetensors file or folder into the (awake) weights in place, checked first;
        state computed from the old weights (a prefix cache) is forgotten."""
        ack = self.worker.update_weights(path, check_finite=check_finite)
        self._after_weights_changed()
        self.weight_version = None  # a checkpoint from disk is no trainer's version
        return ack

    def _apply_synced(self, tensors: dict[str, torch.Tensor], version: str) -> Ack:
        """A trainer's checked weights into the live ones, in place (every rank's slices
        of them on a tensor-parallel stage: its worker's ``apply_synced``)."""
        apply = getattr(self.worker, "apply_synced", None)
        if apply is not None:
            ack: Ack = apply(tensors, version)
        else:
            ack = self.sleep_control.apply_synced(tensors, self.worker.weight_targets, version)
        self._after_weights_changed()
        self.weight_version = version or None  # finished without a version: none
        return ack

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False for a kind that keeps none."""
        return False

    def adopt_history(self, sources: list[str], *, load: bool) -> None:
        """Take over a previous process's weight history (every rank's)."""
        self.worker.adopt_history(sources, load=load)

    def memory_stats(self) -> dict[str, Any]:
        return self.sleep_control.memory_stats()

    def control_status(self) -> dict[str, Any]:
        """The part of ``status()`` every kind reports alike."""
        control = self.sleep_control
        return {
            "stage_id": self.stage_id,
            "kind": self.config.kind,
            "level": control.level,
            "is_sleeping": self.is_sleeping(),
            "sleeping_tags": control.sleeping_tags,
            "is_paused": self.is_paused,
            "pause_mode": self._pause_mode,
            "weights_valid": control.weights_valid,
            "weight_sources": control.weight_sources,
            "weight_version": self.weight_version,
        }
