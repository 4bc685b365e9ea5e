"""AsyncOmni: one engine client for a whole multi-stage pipeline.

It routes a request through the stages it needs (streaming stage 0, handing each stage's
final output to the next through the configured input processor), and orders every control
operation: admission closes per stage, in-flight submits finish, AR stages sleep through
their scheduler (pause → release) and diffusion stages through their worker, ACKs come back
one per stage. Other stages keep serving while one sleeps.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from omnistage.config import PipelineConfig
from omnistage.engine import admission as adm
from omnistage.engine.autopilot import Autopilot
from omnistage.engine.input_processors import get_input_processor
from omnistage.engine.outputs import OmniRequestOutput
from omnistage.engine.router import RequestRouter
from omnistage.engine.stage_client import InProcStageClient, StageProcClient
from omnistage.errors import InvalidRequestError, SleepModeDisabledError
from omnistage.stage.sleep_control import SLEEP_LEVELS, SLEEP_MODES

KNOWN_TAGS = ("weights", "kv_cache")

StageClient = StageProcClient | InProcStageClient


class AsyncOmni:
    """Build with ``from_config`` / ``from_pipeline``; close with ``shutdown()``."""

    def __init__(
        self,
        config: PipelineConfig,
        clients: Sequence[StageClient],
        *,
        resume_after_wake: bool = False,
        auto_wake: bool = False,
    ) -> None:
        self.config = config
        self.clients = list(clients)
        self.gate = adm.AdmissionGate(len(self.clients))
        # The HTTP server wakes and resumes in one call; the Python API (as the seed) does not.
        self.resume_after_wake = resume_after_wake
        self._control_listeners: list[Callable[[str, list[dict[str, Any]]], None]] = []
        self.router = RequestRouter(config, self.clients, self.gate, self._prepare_stages)
        self.autopilot = Autopilot(self, auto_wake=auto_wake)
        for client in self.clients:
            client.on_death(self._on_stage_death)

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        config: PipelineConfig,
        *,
        in_process: bool = False,
        stage_init_timeout_s: float = 600.0,
        resume_after_wake: bool = False,
        auto_wake: bool = False,
    ) -> AsyncOmni:
        """Start every stage (in parallel) and wait for their ready handshakes."""
        for stage in config.stages:
            if stage.input_processor is not None:
                get_input_processor(stage.input_processor)  # fail early on a typo
        threads = max(1, (os.cpu_count() or 1) // len(config.stages))
        clients: list[StageClient] = []
        try:
            for stage in config.stages:
                if in_process:
                    clients.append(InProcStageClient(stage))
                else:
                    clients.append(
                        StageProcClient(
                            stage,
                            num_threads=stage.torch_threads or threads,
                            ready_timeout_s=stage_init_timeout_s,
                        )
                    )
                clients[-1].start()
            for client in clients:
                client.wait_ready()
        except BaseException:
            for client in clients:
                client.shutdown()
            raise
        return cls(config, clients, resume_after_wake=resume_after_wake, auto_wake=auto_wake)

    @classmethod
    def from_pipeline(cls, name: str, **overrides: Any) -> AsyncOmni:
        """A built-in pipeline (``tiny-omni``, ``tiny-image``, ``tiny-chat``, ``bench``)."""
        from omnistage.pipelines import load_pipeline

        options = {
            k: overrides.pop(k)
            for k in ("in_process", "stage_init_timeout_s", "resume_after_wake", "auto_wake")
            if k in overrides
        }
        return cls.from_config(load_pipeline(name, **overrides), **options)

    @property
    def num_stages(self) -> int:
        return len(self.clients)

    @property
    def sleep_mode_enabled(self) -> bool:
        """False when no stage may sleep (the HTTP layer then answers 501, as the seed)."""
        return any(s.enable_sleep_mode for s in self.config.stages)

    # -- data path (see router.py) -------------------------------------------------------

    def output_modalities(self) -> list[str]:
        return self.router.output_modalities()

    def plan(self, modalities: Sequence[str] | None) -> list[int]:
        return self.router.plan(modalities)

    def generate(
        self,
        prompt: str | dict[str, Any],
        sampling_params: dict[str, Any] | None = None,
        modalities: Sequence[str] | None = None,
        *,
        image_params: dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[OmniRequestOutput]:
        """Stream a request through the pipeline (see ``RequestRouter.generate``)."""
        return self.router.generate(
            prompt, sampling_params, modalities, image_params=image_params, request_id=request_id
        )

    async def abort(self, request_id: str) -> None:
        await self.router.abort(request_id)

    async def _prepare_stages(self, chain: list[int]) -> None:
        self._refresh_deaths()
        await self.autopilot.ensure_awake(chain)

    def start_background_tasks(self) -> None:
        """Start the idle monitor (stages with ``idle_sleep_s``); call from the running loop."""
        self.autopilot.start_idle_monitor()

    # -- control ------------------------------------------------------------------------

    def _check_stage_ids(self, stage_ids: Sequence[int] | None) -> list[int]:
        if stage_ids is None:
            return list(range(self.num_stages))
        ids = list(dict.fromkeys(stage_ids))
        bad = [sid for sid in ids if not isinstance(sid, int) or not 0 <= sid < self.num_stages]
        if bad:
            raise ValueError(
                f"unknown stage ids {bad}; valid stage ids are 0..{self.num_stages - 1}"
            )
        return ids

    def _check_sleep_mode(self, stage_ids: list[int]) -> None:
        for sid in stage_ids:
            if not self.config.stages[sid].enable_sleep_mode:
                raise SleepModeDisabledError(sid)

    def split_stage_ids_by_type(self, stage_ids: list[int]) -> tuple[list[int], list[int]]:
        ar = [sid for sid in stage_ids if self.config.stages[sid].kind == "ar"]
        return ar, [sid for sid in stage_ids if sid not in ar]

    async def _call_each(self, stage_ids: list[int], method: str, **args: Any) -> dict[int, Any]:
        """One utility call per stage, in parallel; exceptions are returned, not raised."""
        results = await asyncio.gather(
            *(self.clients[sid].call(method, **args) for sid in stage_ids), return_exceptions=True
        )
        return dict(zip(stage_ids, results, strict=True))

    def reset_mm_cache(self, stage_ids: list[int]) -> None:
        """Drop front-end caches keyed to the stages' state before they sleep.

        The front end keeps no multimodal or prefix cache of its own today; engines reset
        theirs on sleep. Kept as the ordering point the seed describes (front end first).
        """

    async def sleep(
        self,
        stage_ids: Sequence[int],
        level: int = 2,
        mode: str = "abort",
        tags: Sequence[str] | None = None,
    ) -> list[dict[str, Any]]:
        ids = self._check_stage_ids(stage_ids)
        self._refresh_deaths()
        self._check_control_args(level=level, mode=mode, tags=tags)
        self._check_sleep_mode(ids)
        if not ids:
            return []
        previous = self.gate.begin_transition(ids, adm.SLEEPING)
        was_paused = {sid: self.gate.stages[sid].paused for sid in ids}
        # Shielded: a caller that gives up (timeout, cancelled task) must not leave the stages
        # marked mid-transition; the sleep runs to its end and records what really happened.
        return await asyncio.shield(
            self._sleep(ids, previous, was_paused, level=level, mode=mode, tags=tags)
        )

    async def _sleep(
        self,
        ids: list[int],
        previous: dict[int, str],
        was_paused: dict[int, bool],
        *,
        level: int,
        mode: str,
        tags: Sequence[str] | None,
    ) -> list[dict[str, Any]]:
        for sid in ids:
            self.gate.stages[sid].sleep_mode = mode
        await self.gate.close_and_drain_admission(ids)
        results: dict[int, Any] = {}
        if mode == "wait":
            timeout_s = max(self.config.stages[sid].drain_timeout_s for sid in ids)
            try:
                await self.gate.drain_bound(ids, timeout_s)
            except TimeoutError as exc:
                results = dict.fromkeys(ids, exc)
        self.reset_mm_cache(ids)
        ar_ids, diffusion_ids = self.split_stage_ids_by_type(ids)
        args = {"level": level, "mode": mode, "tags": list(tags) if tags is not None else None}
        # AR stages go down the engine-core path (pause scheduler, then release); diffusion
        # stages have no scheduler and take the worker path. Both are one utility call here.
        if not results:
            results = {
                **await self._call_each(ar_ids, "sleep", **args),
                **await self._call_each(diffusion_ids, "sleep", **args),
            }
        acks = []
        reopen = []
        for sid in ids:
            ack = self._as_ack(sid, results[sid], level=level, mode=mode)
            if ack["status"] == "ERROR" and ack["metadata"].get("sleeping_tags"):
                # Failed half-way: part of the stage's memory is gone, so it is asleep (a
                # wake maps it back and reloads); the ACK says what failed.
                await self.gate.set_state(sid, adm.ASLEEP, level=2)
            elif ack["status"] == "ERROR":
                await self.gate.set_state(sid, previous[sid], paused=was_paused[sid])
                if previous[sid] == adm.AWAKE and not was_paused[sid]:
                    reopen.append(sid)
            else:
                await self.gate.set_state(sid, adm.ASLEEP, level=level)
            acks.append(ack)
        # A sleep that failed after its engine paused must not leave the engine paused behind
        # an open gate: admitted requests would wait there for a resume nobody sends.
        await self._call_each(reopen, "resume")
        self._notify_control("sleep", acks)
        self._raise_if_dead(results)
        return acks

    def add_control_listener(self, listener: Callable[[str, list[dict[str, Any]]], None]) -> None:
        """``listener(operation, acks)`` after every sleep / wake_up (metrics, logs)."""
        self._control_listeners.append(listener)

    def _notify_control(self, operation: str, acks: list[dict[str, Any]]) -> None:
        for listener in self._control_listeners:
            listener(operation, acks)

    async def wake_up(
        self,
        stage_ids: Sequence[int] | None = None,
        tags: Sequence[str] | None = None,
        reload: bool = True,
        resume: bool | None = None,
    ) -> list[dict[str, Any]]:
        ids = self._check_stage_ids(stage_ids)
        self._refresh_deaths()
        self._check_control_args(tags=tags)
        self._check_sleep_mode(ids)
        if not ids:
            return []
        previous = self.gate.begin_transition(ids, adm.WAKING)
        should_resume = self.resume_after_wake if resume is None else resume
        # Shielded for the same reason as ``sleep``.
        return await asyncio.shield(
            self._wake_up(ids, previous, tags=tags, reload=reload, resume=should_resume)
        )

    async def _wake_up(
        self,
        ids: list[int],
        previous: dict[int, str],
        *,
        tags: Sequence[str] | None,
        reload: bool,
        resume: bool,
    ) -> list[dict[str, Any]]:
        results = await self._call_each(
            ids, "wake_up", tags=list(tags) if tags is not None else None, reload=reload
        )
        acks = []
        to_resume = []
        for sid in ids:
            ack = self._as_ack(sid, results[sid])
            still_asleep = bool(ack["metadata"].get("sleeping_tags"))
            if ack["status"] != "ERROR" and "weights_valid" in ack["metadata"]:
                self.gate.stages[sid].weights_valid = bool(ack["metadata"]["weights_valid"])
            was_asleep = previous[sid] == adm.ASLEEP
            if ack["status"] == "ERROR" or still_asleep:
                await self.gate.set_state(
                    sid, previous[sid] if ack["status"] == "ERROR" else adm.ASLEEP
                )
            elif self.config.stages[sid].kind == "diffusion":
                # Resumes by itself once really woken; a stage that was only paused stays so.
                await self.gate.set_state(
                    sid, adm.AWAKE, paused=False if was_asleep else None, level=None
                )
            else:
                # AR stages stay paused until resume_generation() (the seed's semantics).
                await self.gate.set_state(sid, adm.AWAKE, level=None)
                if resume and was_asleep:
                    to_resume.append(sid)
            acks.append(ack)
        self._notify_control("wake_up", acks)
        # Every stage is settled before resuming: a resume that fails must not leave the
        # other stages marked as waking.
        if to_resume:
            await self.resume_generation(to_resume)
        self._raise_if_dead(results)
        return acks

    async def pause_generation(
        self, stage_ids: Sequence[int] | None = None, mode: str = "abort"
    ) -> None:
        ids = self._check_stage_ids(stage_ids)
        self._check_control_args(mode=mode)
        await self.gate.close_and_drain_admission(ids)
        awake = [sid for sid in ids if self.gate.stages[sid].state == adm.AWAKE]
        self._raise_first(await self._call_each(awake, "pause", mode=mode))

    async def resume_generation(self, stage_ids: Sequence[int] | None = None) -> None:
        ids = self._check_stage_ids(stage_ids)
        awake = [sid for sid in ids if self.gate.stages[sid].state == adm.AWAKE]
        self._raise_first(await self._call_each(awake, "resume"))
        await self.gate.reopen(awake)

    async def update_weights(self, stage_id: int, path: str) -> dict[str, Any]:
        (sid,) = self._check_stage_ids([stage_id])
        result = dict(await self.clients[sid].call("update_weights", path=str(path)))
        if result.get("status") == "SUCCESS":
            self.gate.stages[sid].weights_valid = True
        return result

    async def stage_status(self) -> list[dict[str, Any]]:
        self._refresh_deaths()
        statuses = []
        for sid, client in enumerate(self.clients):
            s = self.gate.stages[sid]
            engine: dict[str, Any] = {}
            if s.state != adm.DEAD:
                try:
                    engine = dict(await asyncio.wait_for(client.call("status"), timeout=10))
                except Exception as exc:  # status must not fail because one stage does
                    engine = {"error": str(exc)}
            statuses.append(
                {
                    "stage_id": sid,
                    "kind": client.kind,
                    "name": self.config.stages[sid].display_name,
                    "state": s.state,
                    "level": s.level,
                    "paused": s.paused,
                    "in_flight": client.num_in_flight,
                    "pid": client.pid,
                    "enable_sleep_mode": self.config.stages[sid].enable_sleep_mode,
                    "detail": s.detail,
                    **{
                        k: v
                        for k, v in engine.items()
                        if k not in {"stage_id", "kind", "level", "paused"}
                    },
                }
            )
        return statuses

    def sleeping_stage_ids(self) -> set[int]:
        """Stages whose memory is (at least partly) asleep, or going there, and stages woken
        without their weights (reload=false, not yet updated): the truth the HTTP layer
        mirrors. A wakeup racing a sleep then meets the transition (409, not SKIPPED), and a
        wakeup with reload=true reaches a stage whose weights are still missing."""
        sleeping = (adm.SLEEPING, adm.ASLEEP, adm.WAKING)
        return {
            sid
            for sid, s in enumerate(self.gate.stages)
            if s.state in sleeping or (s.state == adm.AWAKE and not s.weights_valid)
        }

    def is_sleeping(self, stage_id: int | None = None) -> bool:
        sleeping = self.sleeping_stage_ids()
        return bool(sleeping) if stage_id is None else stage_id in sleeping

    def is_paused(self, stage_id: int | None = None) -> bool:
        ids = range(self.num_stages) if stage_id is None else [stage_id]
        return any(self.gate.stages[sid].paused for sid in ids)

    def dead_stage_ids(self) -> list[int]:
        self._refresh_deaths()
        return [sid for sid, s in enumerate(self.gate.stages) if s.state == adm.DEAD]

    def _refresh_deaths(self) -> None:
        # A stage that dies before any call attached its client to the loop is only flagged
        # on the client; mirror it into the gate.
        for sid, client in enumerate(self.clients):
            if client.is_dead and self.gate.stages[sid].state != adm.DEAD:
                self.gate.stages[sid].state = adm.DEAD
                self.gate.stages[sid].detail = client.death_reason

    def _on_stage_death(self, stage_id: int) -> None:
        self.gate.mark_dead(stage_id, self.clients[stage_id].death_reason)

    def _check_control_args(
        self,
        *,
        level: int | None = None,
        mode: str | None = None,
        tags: Sequence[str] | None = None,
    ) -> None:
        if level is not None and (isinstance(level, bool) or level not in SLEEP_LEVELS):
            raise InvalidRequestError(
                "level", f"must be one of {list(SLEEP_LEVELS)}, got {level!r}"
            )
        if mode is not None and mode not in SLEEP_MODES:
            raise InvalidRequestError("mode", f"must be one of {list(SLEEP_MODES)}, got {mode!r}")
        if tags is not None:
            if not tags:
                raise InvalidRequestError("tags", "must not be empty; leave it out for every tag")
            bad = [t for t in tags if t not in KNOWN_TAGS]
            if bad:
                raise InvalidRequestError(
                    "tags", f"unknown tags {bad}; known tags are {list(KNOWN_TAGS)}"
                )

    def _as_ack(self, stage_id: int, result: Any, **metadata: Any) -> dict[str, Any]:
        if not isinstance(result, BaseException):
            return dict(result)
        from omnistage.stage.sleep_control import make_ack

        return make_ack(
            stage_id, status="ERROR", error_msg=f"{type(result).__name__}: {result}", **metadata
        )

    @staticmethod
    def _raise_if_dead(results: dict[int, Any]) -> None:
        from omnistage.errors import StageDeadError

        for result in results.values():
            if isinstance(result, StageDeadError):
                raise result

    @staticmethod
    def _raise_first(results: dict[int, Any]) -> None:
        for result in results.values():
            if isinstance(result, BaseException):
                raise result

    def shutdown(self) -> None:
        self.autopilot.stop()
        for client in self.clients:
            client.shutdown()

    async def __aenter__(self) -> AsyncOmni:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()
