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
from omnistage.engine.stage_client import _StageClientBase
from omnistage.errors import OmnistageError, StageAsleepError, StageBusyError
from omnistage.stage.messages import AbortRequest, ToStage, UtilityCall, UtilityResult
from omnistage.stage.sleep_control import make_ack


class FakeStage(_StageClientBase):
    pid = None

    def __init__(self, config: StageConfig) -> None:
        super().__init__(config)
        self.sent: list[ToStage] = []
        self.hold: set[str] = set()
        self.held: list[UtilityCall] = []
        self.fail: set[str] = set()

    def start(self) -> None: ...
    def wait_ready(self) -> None: ...
    def shutdown(self) -> None: ...

    def _send(self, msg: ToStage) -> None:
        self.sent.append(msg)
        if isinstance(msg, UtilityCall):
            if msg.method in self.hold:
                self.held.append(msg)
            else:
                asyncio.get_running_loop().call_soon(self._reply, msg)

    def release(self, method: str) -> None:
        for call in [c for c in self.held if c.method == method]:
            self.held.remove(call)
            self._reply(call)

    def calls(self, method: str) -> list[UtilityCall]:
        return [m for m in self.sent if isinstance(m, UtilityCall) and m.method == method]

    def _reply(self, call: UtilityCall) -> None:
        if call.method in self.fail:
            result = UtilityResult(call.call_id, error_type="RuntimeError", error_message="boom")
        elif call.method in ("sleep", "wake_up"):
            result = UtilityResult(call.call_id, result=make_ack(self.stage_id))
        else:
            result = UtilityResult(call.call_id, result=None)
        self._dispatch(result)


def make_omni(**options: Any) -> tuple[AsyncOmni, list[FakeStage]]:
    config = PipelineConfig(
        stages=[
            StageConfig(stage_id=0, kind="ar", model="unused", enable_sleep_mode=True),
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
    stages = [FakeStage(s) for s in config.stages]
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


async def test_a_failed_resume_after_wake_leaves_no_stage_waking():
    omni, stages = make_omni(resume_after_wake=True)
    await omni.sleep([0, 1], level=1)
    stages[0].fail = {"resume"}
    with pytest.raises(OmnistageError, match="boom"):
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
    await asyncio.sleep(0)  # submitted; leaving admission
    step.cancel()
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
