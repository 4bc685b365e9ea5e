"""AsyncOmni: one engine client for a whole multi-stage pipeline.

A facade over the pieces that do the work: ``RequestRouter`` (the data path),
``StageControl`` (sleep, wake, pause, resume, weight updates), ``AdmissionGate`` (per-stage
state and admission), ``Autopilot`` (auto-wake, idle sleep) and ``Supervisor`` (restarts of
stages whose process died). Stages are started by a ``StageLauncher`` (local processes by
default). The public control methods return ACKs as plain dicts, vLLM-Omni's shape.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from typing import Any

from omnistage.config import ConfigError, PipelineConfig
from omnistage.engine import admission as adm
from omnistage.engine.autopilot import Autopilot
from omnistage.engine.control import StageControl
from omnistage.engine.launcher import InProcessLauncher, LocalProcessLauncher, StageLauncher
from omnistage.engine.outputs import OmniRequestOutput
from omnistage.engine.replica_parts import check_replicas
from omnistage.engine.replicas import replicated
from omnistage.engine.request_stats import StatsListener
from omnistage.engine.router import RequestRouter
from omnistage.engine.spawn import SpawnedStage, stage_threads, uses_ray
from omnistage.engine.stage_client import EngineStageClient, StageClient
from omnistage.engine.stage_params import merge_stage_params
from omnistage.engine.supervisor import RestartPolicy, Supervisor
from omnistage.engine.weights import WeightSyncClient
from omnistage.models import registry
from omnistage.stage.control import Ack
from omnistage.stage.kinds import check_kinds
from omnistage.stage.request_preparer import RequestOptions

AckListener = Callable[[str, list[dict[str, Any]]], None]
_FROM_CONFIG_OPTIONS = (
    "in_process",
    "distributed_executor_backend",
    "launcher",
    "stage_init_timeout_s",
    "resume_after_wake",
    "auto_wake",
    "paused_request_timeout_s",
    "restart_policy",
)


class AsyncOmni:
    """Build with ``from_config`` / ``from_pipeline``; close with ``shutdown()``."""

    def __init__(
        self,
        config: PipelineConfig,
        clients: Sequence[EngineStageClient],
        *,
        resume_after_wake: bool = False,
        auto_wake: bool = False,
        restart_policy: RestartPolicy | None = None,
        paused_request_timeout_s: float = 300.0,
    ) -> None:
        self.config = config
        self.clients = list(clients)
        self.gate = adm.AdmissionGate(
            len(self.clients), auto_wake=auto_wake, paused_wait_s=paused_request_timeout_s
        )
        self.control = StageControl(
            config, self.clients, self.gate, resume_after_wake=resume_after_wake
        )
        self.router = RequestRouter(config, self.clients, self.gate, self._prepare_stages)
        self.autopilot = Autopilot(
            self.control, lambda sid: self.clients[sid].num_in_flight, auto_wake=auto_wake
        )
        self.supervisor = Supervisor(
            self.clients, self.gate, restart_policy, names=[s.display_name for s in config.stages]
        )
        self.control.add_listener(self.supervisor.observe_control)
        self.weights = WeightSyncClient(self.control)
        self._attached = False

    # -- construction -------------------------------------------------------------------

    @classmethod
    def from_config(
        cls,
        config: PipelineConfig,
        *,
        in_process: bool = False,
        launcher: StageLauncher | None = None,
        stage_init_timeout_s: float = 600.0,
        resume_after_wake: bool = False,
        auto_wake: bool = False,
        restart_policy: RestartPolicy | None = None,
        prestarted: dict[int, SpawnedStage] | None = None,
        distributed_executor_backend: str = "mp",
        paused_request_timeout_s: float = 300.0,
    ) -> AsyncOmni:
        """Start every stage (in parallel) and wait for their ready handshakes; stages in
        ``prestarted`` (``spawn.prestart``) are taken over instead of spawned."""
        check_kinds(config)
        for stage in config.stages:
            if stage.input_processor is not None:
                processor = registry.processor(stage.input_processor)  # fail early on a typo
                if stage.stream and processor.stream is None and processor.stream_embeds is None:
                    raise ConfigError(
                        f"stages.{stage.stage_id}.stream: processor {stage.input_processor!r} "
                        "cannot stream its input; set stream: false"
                    )
        ray = launcher is None and not in_process and uses_ray(config, distributed_executor_backend)
        check_replicas(config, on_ray=ray)
        if launcher is None:
            num_processes = sum(stage.replicas for stage in config.stages)
            threads = lambda stage: stage_threads(stage, num_processes)  # noqa: E731
            if in_process:
                launcher = InProcessLauncher()
            elif uses_ray(config, distributed_executor_backend):
                from omnistage.engine.ray_launcher import RayLauncher

                launcher = RayLauncher(threads, ready_timeout_s=stage_init_timeout_s)
            else:
                launcher = LocalProcessLauncher(
                    threads, ready_timeout_s=stage_init_timeout_s, prestarted=prestarted
                )
        clients = [
            replicated(
                [StageClient(stage.replica_config(i), launcher) for i in range(stage.replicas)]
            )
            for stage in config.stages
        ]
        try:
            for client in clients:
                client.start()
            for client in clients:
                client.wait_ready()
        except BaseException:
            for client in clients:
                client.shutdown()
            raise
        return cls(
            config, clients, resume_after_wake=resume_after_wake, auto_wake=auto_wake,
            restart_policy=restart_policy, paused_request_timeout_s=paused_request_timeout_s,
        )  # fmt: skip

    @classmethod
    def from_model(cls, model: str, **overrides: Any) -> AsyncOmni:
        """The pipeline a checkpoint folder asks for (``pipelines.pipeline_from_model``): its
        model family's — one AR stage for a decoder-only model, thinker → talker → code2wav
        for a speaking omni model. ``overrides`` are stage settings for every stage, or
        ``from_config``'s options."""
        from omnistage.pipelines import pipeline_from_model

        options = {k: overrides.pop(k) for k in _FROM_CONFIG_OPTIONS if k in overrides}
        return cls.from_config(pipeline_from_model(str(model), **overrides), **options)

    @classmethod
    def from_pipeline(cls, name: str, **overrides: Any) -> AsyncOmni:
        """A built-in pipeline (``tiny-omni``, ``tiny-image``, ``tiny-chat``, ``bench``)."""
        from omnistage.pipelines import load_pipeline

        options = {k: overrides.pop(k) for k in _FROM_CONFIG_OPTIONS if k in overrides}
        return cls.from_config(load_pipeline(name, **overrides), **options)

    def _attach(self) -> None:
        """Bind the stage clients to the running loop (stages that died before are reported
        now, so the supervisor restarts them)."""
        if self._attached:
            return
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return  # not on a loop yet: the first call from one attaches
        self._attached = True
        for client in self.clients:
            client.attach()

    def start_background_tasks(self) -> None:
        """Attach to the running loop and start the idle monitor; call from the loop."""
        self._attach()
        self.autopilot.start_idle_monitor()

    @property
    def num_stages(self) -> int:
        return len(self.clients)

    @property
    def sleep_mode_enabled(self) -> bool:
        """False when no stage may sleep (the HTTP layer then answers 501)."""
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
        talker_params: dict[str, Any] | None = None,
        audio_params: dict[str, Any] | None = None,
        stage_params: Sequence[Mapping[str, Any] | None] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[OmniRequestOutput]:
        """Stream a request through the pipeline (see ``RequestRouter.generate``):
        each stage takes the parameters of the field its kind or model names: token stages
        ``sampling_params`` (a speech-token stage ``talker_params``), image stages
        ``image_params``, speech stages ``audio_params`` (voice, seed, ...); ``stage_params``
        gives them per stage in stage order instead (vLLM-Omni's ``sampling_params_list``,
        see ``stage_params.py``). Text deltas stream as they come; images and audio when
        their stage ends."""
        self._attach()
        by_field = {"image_params": image_params, "talker_params": talker_params}
        options = self._options(
            sampling_params, stage_params, audio_params=audio_params, **by_field
        )
        return self.router.generate(prompt, options, modalities, request_id=request_id)

    def check(
        self,
        prompt: str | dict[str, Any],
        sampling_params: dict[str, Any] | None = None,
        modalities: Sequence[str] | None = None,
        **params: Any,
    ) -> None:
        """Check a request as ``generate`` (with its parameters) would before any stage runs
        (``InvalidRequestError`` naming the field), running nothing: for work answered before
        it starts (a job)."""
        self._attach()
        options = self._options(sampling_params, **params)
        self.router.check(prompt, options, list(modalities or self.output_modalities()))

    def _options(
        self,
        sampling_params: Mapping[str, Any] | None,
        stage_params: Sequence[Mapping[str, Any] | None] | None = None,
        **by_field: Mapping[str, Any] | None,
    ) -> RequestOptions:
        given = {"sampling_params": sampling_params, **by_field}
        if stage_params is None:
            return RequestOptions.of(**given)
        preparers = [self.router.preparer(i) for i in range(self.num_stages)]
        return RequestOptions.of(**merge_stage_params(given, stage_params, preparers))

    async def abort(self, request_id: str) -> None:
        await self.router.abort(request_id)

    async def _prepare_stages(self, chain: list[int]) -> None:
        await self.autopilot.ensure_awake(chain)

    # -- control (see control.py) --------------------------------------------------------

    async def sleep(
        self,
        stage_ids: Sequence[int],
        level: int = 2,
        mode: str = "abort",
        tags: Sequence[str] | None = None,
        replica_ids: Sequence[int] | None = None,
    ) -> list[dict[str, Any]]:
        """``replica_ids``: only those replicas of each stage (``StageControl.sleep``)."""
        self._attach()
        options = {"level": level, "mode": mode, "tags": tags, "replica_ids": replica_ids}
        return _dicts(await self.control.sleep(stage_ids, **options))  # type: ignore[arg-type]

    async def wake_up(
        self,
        stage_ids: Sequence[int] | None = None,
        tags: Sequence[str] | None = None,
        reload: bool = True,
        resume: bool | None = None,
        replica_ids: Sequence[int] | None = None,
    ) -> list[dict[str, Any]]:
        self._attach()
        options = {"tags": tags, "reload": reload, "resume": resume, "replica_ids": replica_ids}
        return _dicts(await self.control.wake_up(stage_ids, **options))  # type: ignore[arg-type]

    async def pause_generation(
        self, stage_ids: Sequence[int] | None = None, mode: str = "abort"
    ) -> None:
        self._attach()
        await self.control.pause(stage_ids, mode=mode)

    async def resume_generation(self, stage_ids: Sequence[int] | None = None) -> None:
        self._attach()
        await self.control.resume(stage_ids)

    async def update_weights(
        self, stage_id: int, path: str, check_finite: bool = True
    ) -> list[dict[str, Any]]:
        """Load a safetensors file or folder into a stage's weights in place; the tensors are
        checked (names, shapes, and NaN/Inf unless ``check_finite`` is False) first. The ACKs:
        one per rank."""
        self._attach()
        return _dicts(await self.control.update_weights(stage_id, path, check_finite))

    # -- RL: weight sync without disk, prefix cache, abort (see weights.py) ----------------

    async def init_weight_transfer(
        self,
        stage_id: int,
        backend: str = "nccl",
        init_info: dict[str, Any] | None = None,
        *,
        abort_open: bool = False,
    ) -> dict[str, Any]:
        """Join a trainer for weight syncs (``nccl``: answers once the trainer is there; the
        stage serves meanwhile)."""
        self._attach()
        return await self.weights.init(stage_id, backend, init_info, abort_open=abort_open)

    async def start_weight_update(
        self,
        stage_id: int,
        update_info: dict[str, Any] | None = None,
        *,
        require_session: bool = False,
        abort_open: bool = False,
    ) -> dict[str, Any]:
        """Open an update session (one at a time per stage); the reply names it."""
        self._attach()
        return await self.weights.start(
            stage_id, update_info, require_session=require_session, abort_open=abort_open
        )

    async def receive_weights(
        self, stage_id: int, update_info: dict[str, Any], *, session: str | None = None
    ) -> dict[str, Any]:
        """One chunk of an update (the trainer broadcasts or shares it meanwhile)."""
        self._attach()
        return await self.weights.update(stage_id, update_info, session=session)

    async def finish_weight_update(
        self, stage_id: int, weight_version: str | int | None = None, *, session: str | None = None
    ) -> list[dict[str, Any]]:
        """Apply the update in place, all or nothing; the ACKs carry ``weight_version``."""
        self._attach()
        return _dicts(await self.weights.finish(stage_id, weight_version, session=session))

    async def abort_weight_update(
        self, stage_id: int, *, session: str | None = None
    ) -> dict[str, Any]:
        """End an update session without applying it (its owner giving up)."""
        self._attach()
        return await self.weights.abort(stage_id, session=session)

    async def weights_checksum(self, stage_id: int) -> str:
        self._attach()
        return await self.weights.checksum(stage_id)

    def weight_version(self, stage_id: int = 0) -> str | None:
        return self.weights.versions.get(stage_id)

    async def reset_prefix_cache(self, stage_ids: Sequence[int] | None = None) -> list[int]:
        """Forget every AR stage's cached prefixes; returns the stages reset."""
        self._attach()
        return await self.control.reset_prefix_cache(stage_ids)

    async def abort_requests(self, request_ids: Sequence[str]) -> None:
        for request_id in request_ids:
            await self.router.abort(request_id)

    def add_request_listener(self, listener: StatsListener) -> None:
        """``listener(stats)`` when a stage finishes a sample of a request (its timings)."""
        self.router.stats_listeners.append(listener)

    def add_control_listener(self, listener: AckListener) -> None:
        """``listener(operation, acks)`` after every sleep / wake_up / update_weights."""
        self.control.add_listener(lambda op, acks: listener(op, _dicts(acks)))

    async def stage_status(self) -> list[dict[str, Any]]:
        self._attach()
        return await self.control.stage_status()

    def sleeping_stage_ids(self) -> set[int]:
        return self.control.sleeping_stage_ids()

    def is_sleeping(self, stage_id: int | None = None) -> bool:
        sleeping = self.sleeping_stage_ids()
        return bool(sleeping) if stage_id is None else stage_id in sleeping

    def is_paused(self, stage_id: int | None = None) -> bool:
        return self.control.is_paused(stage_id)

    def dead_stage_ids(self) -> list[int]:
        """Stages whose process is gone: dead for good, or being restarted."""
        self._attach()
        return self.control.dead_stage_ids()

    def stage_states(self) -> list[adm.StageState]:
        """The gate's view of each stage (read-only: metrics, health)."""
        return list(self.gate.stages)

    def num_in_flight(self, stage_id: int) -> int:
        return self.clients[stage_id].num_in_flight

    def restarting_stage_ids(self) -> list[int]:
        dead = self.dead_stage_ids()
        return [sid for sid in dead if self.gate.stages[sid].state == adm.RESTARTING]

    def shutdown(self) -> None:
        """Stop every stage, all at once: each process takes most of a second to exit (its
        interpreter and native libraries' teardown), which one after another adds up."""
        self.autopilot.stop()
        self.supervisor.stop()
        stopping = [
            threading.Thread(target=client.shutdown, name=f"stop-stage{sid}")
            for sid, client in enumerate(self.clients)
        ]
        for thread in stopping:
            thread.start()
        for thread in stopping:
            thread.join()

    async def __aenter__(self) -> AsyncOmni:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.shutdown()


def _dicts(acks: list[Ack]) -> list[dict[str, Any]]:
    return [ack.to_dict() for ack in acks]
