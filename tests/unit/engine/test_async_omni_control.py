"""AsyncOmni's control state machine over fake stage clients: no processes, no engines.

A ``FakeStage`` answers utility calls with SUCCESS ACKs on the next loop turn, or holds the
replies to chosen methods until the test releases them, or fails chosen methods.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any

import pytest

from omnistage.config import PipelineConfig, StageConfig
from omnistage.engine.admission import AdmissionGate
from omnistage.engine.async_omni import AsyncOmni
from omnistage.errors import StageAsleepError, StageBusyError, StageDeadError
from omnistage.models.tiny import ensure_preset
from omnistage.pipelines import cache_dir
from omnistage.stage import control as ops
from omnistage.stage.ar.wire import ARStageInfo
from omnistage.stage.control import make_ack
from omnistage.stage.diffusion.params import PipelineLimits
from omnistage.stage.diffusion.wire import DiffusionStageInfo
from omnistage.stage.messages import (
    AbortRequest,
    AddRequest,
    AppendInput,
    ControlCall,
    DiscardHandoff,
    OutputMessage,
    StageInfo,
    StageRequest,
    ToStage,
)

# The operations by the names the tests hold and fail them under.
NAMES = {
    ops.Sleep: "sleep",
    ops.WakeUp: "wake_up",
    ops.Pause: "pause",
    ops.Resume: "resume",
    ops.Status: "status",
    ops.UpdateWeights: "update_weights",
    ops.ResetPrefixCache: "reset_prefix_cache",
}


def method(call: ControlCall) -> str:
    return NAMES[type(call.op)]


class FakeStage:
    """A stage client (the public ``EngineStageClient`` protocol) that runs no stage."""

    pid = None

    def __init__(self, config: StageConfig, info: StageInfo) -> None:
        self.config = config
        self.stage_id = config.stage_id
        self.kind: str = config.kind
        self.info: StageInfo | None = info
        self.is_dead = False
        self.death_reason = ""
        self.sent: list[ToStage] = []
        self.hold: set[str] = set()
        self.held: list[tuple[ControlCall, asyncio.Future[Any]]] = []
        self.fail: set[str] = set()
        self.resumes_on_wake = True  # a wake asked to resume does (False: a kind that ignores it)
        self.queues: dict[str, asyncio.Queue[OutputMessage]] = {}
        self._call_ids = iter(range(1, 10**9))

    @property
    def num_in_flight(self) -> int:
        return len(self.queues)

    def on_death(self, callback: Any) -> None: ...
    def attach(self) -> None: ...
    async def restart(self, options: Any) -> None: ...
    def shutdown(self) -> None: ...

    def add_request(
        self,
        request_id: str,
        request: StageRequest,
        *,
        forward: bool = False,
        upstream: Any = None,
        stream: str | None = None,
        params: Any = None,
    ) -> asyncio.Queue[OutputMessage]:
        if self.is_dead:
            raise StageDeadError(self.stage_id, self.death_reason)
        self.sent.append(
            AddRequest(request_id, request, forward=forward, upstream=upstream, stream=stream)
        )
        self.queues[request_id] = asyncio.Queue()
        return self.queues[request_id]

    def abort(self, request_ids: list[str]) -> None:
        self.sent.append(AbortRequest(request_ids=request_ids))

    def append_input(
        self, request_id: str, token_ids: list[int], final: bool, delta: Any = None
    ) -> None:
        self.sent.append(AppendInput(request_id, token_ids, final, delta))

    def discard(self, ref: Any) -> None:
        self.sent.append(DiscardHandoff(ref))

    async def call(self, op: ops.ControlOp) -> Any:
        call = ControlCall(call_id=next(self._call_ids), op=op)
        self.sent.append(call)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        if method(call) in self.hold:
            self.held.append((call, fut))
        else:
            asyncio.get_running_loop().call_soon(self._reply, call, fut)
        return await fut

    def release(self, name: str) -> None:
        for call, fut in [(c, f) for c, f in self.held if method(c) == name]:
            self.held.remove((call, fut))
            self._reply(call, fut)

    def calls(self, name: str) -> list[ControlCall]:
        return [m for m in self.sent if isinstance(m, ControlCall) and method(m) == name]

    def _reply(self, call: ControlCall, fut: asyncio.Future[Any]) -> None:
        if fut.done():
            return
        if method(call) in self.fail:
            fut.set_exception(RuntimeError("boom"))
        elif isinstance(call.op, ops.Sleep | ops.WakeUp):
            # An AR stage waits for a resume after a wake unless the wake asked it to resume;
            # the others schedule by themselves.
            resumed = isinstance(call.op, ops.WakeUp) and call.op.resume and self.resumes_on_wake
            fut.set_result([make_ack(self.stage_id, paused=self.kind == "ar" and not resumed)])
        else:
            fut.set_result(None)


def make_omni(**options: Any) -> tuple[AsyncOmni, list[FakeStage]]:
    thinker = ensure_preset("demo", cache_dir() / "demo")
    config = PipelineConfig(
        stages=[
            StageConfig(stage_id=0, kind="ar", model=str(thinker), enable_sleep_mode=True),
            StageConfig(
                stage_id=1,
                kind="diffusion",
                model="unused",
                enable_sleep_mode=True,
                input_from=0,
                input_processor="thinker_hidden_to_image_cond",
            ),
        ]
    )
    limits = PipelineLimits(size_multiple=8, embedding_dim=256, has_text_encoder=False)
    infos: list[StageInfo] = [
        ARStageInfo(vocab_size=512, max_model_len=512),
        DiffusionStageInfo(limits=limits),
    ]
    stages = [FakeStage(s, info) for s, info in zip(config.stages, infos, strict=True)]
    return AsyncOmni(config, stages, **options), stages


async def turns(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_resume_racing_a_sleep_does_not_reopen_the_sleeping_stage():
    omni, stages = make_omni()
    stages[0].hold = {"resume", "sleep"}
    resume = asyncio.ensure_future(omni.resume_generation([0]))
    await turns()
    sleep = asyncio.ensure_future(omni.sleep([0], level=1))
    await turns()
    stages[0].release("resume")
    await resume
    with pytest.raises(StageAsleepError):
        await asyncio.wait_for(anext(omni.generate("hi", modalities=["text"])), 1)
    stages[0].release("sleep")
    await sleep
    assert omni.sleeping_stage_ids() == {0}


async def test_a_wake_that_resumes_is_one_call_per_stage():
    omni, stages = make_omni(resume_after_wake=True)
    await omni.sleep([0, 1], level=1)
    await omni.wake_up([0, 1])
    for stage in stages:
        (wake,) = stage.calls("wake_up")
        assert wake.op.resume and not stage.calls("resume")
    assert not omni.is_paused()
    omni_paused, paused_stages = make_omni()  # the Python API's default: woken, still paused
    await omni_paused.sleep([0], level=1)
    await omni_paused.wake_up([0])
    assert not paused_stages[0].calls("wake_up")[0].op.resume and omni_paused.is_paused(0)


async def test_a_failed_resume_after_wake_leaves_no_stage_waking():
    omni, stages = make_omni(resume_after_wake=True)
    await omni.sleep([0, 1], level=1)
    stages[0].resumes_on_wake = False  # so the engine client resumes it with a call of its own
    stages[0].fail = {"resume"}
    with pytest.raises(RuntimeError, match="boom"):
        await omni.wake_up([0, 1])
    assert omni.sleeping_stage_ids() == set()
    assert (await omni.sleep([1], level=1))[0]["status"] == "SUCCESS"  # not busy "waking"


async def test_a_cancelled_sleep_still_records_what_the_stage_did():
    omni, stages = make_omni()
    stages[1].hold = {"sleep"}
    sleep = asyncio.ensure_future(omni.sleep([1], level=1))
    await turns()
    sleep.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sleep
    stages[1].release("sleep")
    await turns()
    assert omni.sleeping_stage_ids() == {1}
    assert (await omni.wake_up([1]))[0]["status"] == "SUCCESS"  # not busy "sleeping"


async def test_waking_a_merely_paused_diffusion_stage_keeps_it_paused():
    omni, _ = make_omni()
    await omni.sleep([0], level=1)
    await omni.pause_generation([1])
    await omni.wake_up([0, 1])
    assert omni.is_paused(1)


async def test_a_caller_cancelled_right_after_submitting_aborts_its_request():
    omni, stages = make_omni()
    step = asyncio.ensure_future(anext(omni.generate("hi", modalities=["text"], request_id="r")))
    async with asyncio.timeout(5):  # the prompt is tokenized on a worker thread first
        while not any(isinstance(m, AddRequest) for m in stages[0].sent):
            await asyncio.sleep(0)
    step.cancel()  # submitted; leaving admission
    with contextlib.suppress(asyncio.CancelledError):
        await step
    assert AbortRequest(request_ids=["r"]) in stages[0].sent


async def test_a_submitter_cancelled_while_leaving_admission_does_not_block_sleep():
    gate = AdmissionGate(1)
    inside, leave = asyncio.Event(), asyncio.Event()

    async def submit() -> None:
        async with gate.admit(0):
            inside.set()
            await leave.wait()

    task = asyncio.ensure_future(submit())
    await inside.wait()
    async with gate.cond:  # the gate's lock is busy when the submitter leaves
        leave.set()
        await turns()
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await asyncio.wait_for(gate.close_and_drain_admission([0]), 1)


async def test_a_wakeup_racing_a_sleep_meets_the_transition():
    omni, stages = make_omni()
    stages[1].hold = {"sleep"}
    sleep = asyncio.ensure_future(omni.sleep([1], level=1))
    await turns()
    assert omni.sleeping_stage_ids() == {1}  # so the HTTP wakeup calls the engine: 409
    with pytest.raises(StageBusyError):
        await omni.wake_up([1])
    stages[1].release("sleep")
    await sleep


async def test_a_mixed_set_of_stages_sleeps_and_wakes_concurrently():
    """An AR and a diffusion stage that both take long: both calls are out at once."""
    omni, stages = make_omni()
    for stage in stages:
        stage.hold = {"sleep", "wake_up"}
    sleep = asyncio.ensure_future(omni.sleep([0, 1], level=1))
    await turns()
    assert [len(s.calls("sleep")) for s in stages] == [1, 1]  # neither waits for the other
    for stage in stages:
        stage.release("sleep")
    assert [ack["status"] for ack in await sleep] == ["SUCCESS", "SUCCESS"]
    wake = asyncio.ensure_future(omni.wake_up([0, 1]))
    await turns()
    assert [len(s.calls("wake_up")) for s in stages] == [1, 1]
    for stage in stages:
        stage.release("wake_up")
    await wake
    assert omni.sleeping_stage_ids() == set()


@pytest.mark.parametrize("auto_wake", [False, True])
def test_a_refusal_names_every_sleeping_stage_and_offers_a_retry_only_with_auto_wake(
    auto_wake: bool,
):
    from omnistage.engine.admission import ASLEEP
    from omnistage.errors import StageRestartingError

    gate = AdmissionGate(3, auto_wake=auto_wake)
    gate.stages[0].state = ASLEEP
    gate.stages[2].state = ASLEEP
    with pytest.raises(StageAsleepError) as refused:
        gate.check_available([0, 1, 2])
    assert refused.value.stage_ids == [0, 2]
    assert refused.value.retry_after is auto_wake
    gate.mark_dead(1, "killed by SIGKILL", restarting=True)
    with pytest.raises(StageRestartingError) as restarting:
        gate.check_available([0, 1, 2])
    assert restarting.value.retry_after  # a restart comes back by itself


async def test_a_request_for_a_paused_stage_waits_within_its_timeout_then_is_refused():
    from omnistage.errors import StagePausedError

    omni, stages = make_omni(paused_request_timeout_s=0.2)
    await omni.sleep([0], level=1)
    await omni.wake_up([0])  # the Python API's default: woken, still paused
    with pytest.raises(StagePausedError, match="--paused-request-timeout-s"):
        await asyncio.wait_for(anext(omni.generate("hi", modalities=["text"])), 5)
    assert not any(isinstance(m, AddRequest) for m in stages[0].sent)
    waiting = asyncio.ensure_future(anext(omni.generate("hi", modalities=["text"])))
    await turns()
    await omni.resume_generation([0])  # resumed in time: the waiting request goes in
    async with asyncio.timeout(5):
        while not any(isinstance(m, AddRequest) for m in stages[0].sent):
            await asyncio.sleep(0.01)
    waiting.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await waiting


async def test_a_wait_sleep_drains_a_stage_after_the_stages_feeding_it():
    """Under a streamed edge the downstream stage's requests end only when their input stops:
    sleeping both with ``wait`` at once timed the downstream out while the upstream still
    drained (code2wav ERROR after 30 s, talker SUCCESS). Upstream first; other modes at once."""
    omni, stages = make_omni()
    for stage in stages:
        stage.hold = {"sleep"}
    sleep = asyncio.ensure_future(omni.sleep([0, 1], level=1, mode="wait"))
    await turns()
    assert [len(s.calls("sleep")) for s in stages] == [1, 0]  # the image stage waits its turn
    stages[0].release("sleep")
    await turns()
    assert [len(s.calls("sleep")) for s in stages] == [1, 1]
    stages[1].release("sleep")
    assert [ack["status"] for ack in await sleep] == ["SUCCESS", "SUCCESS"]
    await omni.wake_up([0, 1])
    keep = asyncio.ensure_future(omni.sleep([0, 1], level=1, mode="keep"))
    await turns()
    assert [len(s.calls("sleep")) for s in stages] == [2, 2]  # no drain: both at once
    for stage in stages:
        stage.release("sleep")
    await keep


async def test_a_sleep_that_begins_while_a_prompt_is_prepared_refuses_it_before_any_stage():
    """The request passed its availability check, then its prompt was prepared (an await)
    while a wait sleep of the image stage began and drained (nothing was bound for it yet).
    It then went in and failed mid-stream at the sleeping stage: admission and the drain
    disagreed on who was in. Now it is counted as bound at once after a second check."""
    omni, stages = make_omni()
    router = omni.router
    prepared, go_on = asyncio.Event(), asyncio.Event()
    prepare_first = router._prepare_first

    async def slow_prepare(*args: Any, **kwargs: Any) -> Any:
        request = await prepare_first(*args, **kwargs)
        prepared.set()
        await go_on.wait()
        return request

    router._prepare_first = slow_prepare  # type: ignore[method-assign]
    first = asyncio.ensure_future(anext(omni.generate("hi", modalities=["image"], request_id="r")))
    await asyncio.wait_for(prepared.wait(), 5)
    acks = await omni.sleep([1], level=1, mode="wait")
    assert acks[0]["status"] == "SUCCESS"
    go_on.set()
    with pytest.raises(StageAsleepError):
        await asyncio.wait_for(first, 5)  # before: submitted to the thinker, failing later
    assert not any(isinstance(m, AddRequest) for m in stages[0].sent)  # refused up front


async def test_a_request_let_in_by_a_wait_drain_meets_a_restarting_stage_as_restarting():
    """A stage killed during a wait sleep's drain: the requests on their way to it were let
    in by the drain and reached a dead client (stage_dead, no Retry-After, for 2.6 s) while
    the server was restarting it (stage_restarting elsewhere). They are told it restarts."""
    from omnistage.errors import StageRestartingError

    gate = AdmissionGate(2)
    gate.add_bound([1])  # a request in the thinker, on its way to stage 1
    gate.begin_transition([1], "sleeping", level=1)
    await gate.close_and_drain_admission([1], sleep_mode="wait")
    drain = asyncio.ensure_future(gate.drain_bound([1], 30))
    await turns()
    assert gate.stages[1].admits_bound
    gate.mark_dead(1, "killed by SIGKILL", restarting=True)
    with pytest.raises(StageRestartingError):
        async with gate.admit(1, bound=True):
            pass
    gate.release_bound([1])  # the refused request leaves the pipeline
    await asyncio.wait_for(drain, 1)
