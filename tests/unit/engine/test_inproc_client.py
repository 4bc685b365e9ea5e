"""The stage client's in-process variant: the same StageCore loop on a thread, no sockets."""

import asyncio
import time
from typing import Any

import pytest
import pytest_asyncio

from omnistage.config import StageConfig
from omnistage.engine.launcher import InProcessLauncher
from omnistage.engine.stage_client import StageClient
from omnistage.errors import InvalidRequestError, StageDeadError
from omnistage.pipelines import cache_dir, ensure_models, load_pipeline
from omnistage.stage import control as ops
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.wire import ARStageRequest
from omnistage.stage.diffusion.wire import DiffusionStageRequest
from omnistage.stage.types import StageOutput


def ar_request(max_tokens: int, ignore_eos: bool = False, ids=(1, 2, 3)) -> ARStageRequest:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)
    return ARStageRequest(prompt_token_ids=list(ids), sampling_params=params)


@pytest_asyncio.fixture(scope="module")
async def client():
    pipeline = load_pipeline("tiny-chat", enable_sleep_mode=True)
    ensure_models(pipeline)
    stage: StageConfig = pipeline.stages[0].model_copy(update={"drain_timeout_s": 0.5})
    c = StageClient(stage, InProcessLauncher())
    c.start()
    c.wait_ready()
    yield c
    c.shutdown()


async def drain(queue):
    outputs = []
    while True:
        out = await asyncio.wait_for(queue.get(), 60)
        outputs.append(out)
        if out.finished:
            return outputs


async def test_request_streams_to_completion(client):
    q = client.add_request("r1", ar_request(max_tokens=5))
    outputs = await drain(q)
    assert outputs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outputs) == 5


async def test_bad_request_fails_with_the_field_named(client):
    q = client.add_request("bad", ar_request(max_tokens=5, ids=[1, 10**9]))
    (out,) = await drain(q)
    assert out.finish_reason == "error" and out.error.type == "InvalidRequestError"
    assert out.error.field == "prompt" and "token ids" in out.error.message


async def test_control_errors_cross_as_data(client):
    with pytest.raises(InvalidRequestError) as info:
        await client.call(ops.UpdateWeights(path="/no/such/checkpoint"))
    assert info.value.field == "path" and "no such file" in str(info.value)
    with pytest.raises(InvalidRequestError) as bad:
        ops.Sleep(level=9)  # refused where it is made, before any stage sees it
    assert bad.value.field == "level"


async def test_sleep_with_wait_replies_after_the_drain(client):
    q = client.add_request("long", ar_request(max_tokens=24, ignore_eos=True))
    (ack,) = await client.call(ops.Sleep(level=1, mode="wait", drain_timeout_s=60))
    assert q.qsize() > 0  # the request's outputs arrived before the reply
    outputs = []
    while not q.empty():
        outputs.append(q.get_nowait())
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert ack.status == "SUCCESS" and ack.metadata.mode == "wait"
    await client.call(ops.WakeUp())
    await client.call(ops.Resume())


async def test_wait_drain_gives_up_after_the_timeout_and_resumes(client):
    q = client.add_request("slow", ar_request(max_tokens=400, ignore_eos=True))
    with pytest.raises(TimeoutError, match=r"after 0.05s \(slow\); raise drain_timeout_s"):
        await client.call(ops.Sleep(level=1, mode="wait", drain_timeout_s=0.05))
    status = await client.call(ops.Status())
    assert not status["is_sleeping"]
    client.abort(["slow"])
    assert (await drain(q))[-1].finish_reason == "abort"


def test_cache_dir_follows_the_environment():
    # tests/conftest.py points it into the repository unless the user set their own.
    import os

    assert str(cache_dir()) == os.environ["OMNISTAGE_CACHE_DIR"]


async def _finish_reasons(outputs):
    return [out.finish_reason async for out in outputs]


async def test_a_sleep_failing_after_the_pause_does_not_strand_later_requests(monkeypatch):
    from omnistage.engine.async_omni import AsyncOmni

    omni = AsyncOmni.from_pipeline("tiny-chat", enable_sleep_mode=True, in_process=True)
    try:
        engine = omni.clients[0]._handle.engine

        def out_of_host_memory(*args, **kwargs):
            raise MemoryError("no room for the host backup")

        # The AR engine pauses, then its memory layer fails.
        monkeypatch.setattr(engine.sleep_control, "sleep", out_of_host_memory)
        (ack,) = await omni.sleep([0], level=1)
        assert ack["status"] == "ERROR" and "host backup" in ack["error_msg"]
        sampling = {"temperature": 0.0, "max_tokens": 4}
        outputs = omni.generate("hi", sampling, ["text"])
        reasons = await asyncio.wait_for(_finish_reasons(outputs), 30)  # not held forever
        assert reasons[-1] == "length"
    finally:
        omni.shutdown()


class SlowEngine:
    """Finishes each request after a step of ``step_s``; records how it was shut down."""

    def __init__(self, step_s: float) -> None:
        self.config = StageConfig(stage_id=0, kind="diffusion", model="unused")
        self.step_s = step_s
        self.waiting: list[Any] = []
        self.is_stepping = False
        self.shut_down_mid_step: bool | None = None

    is_paused = False

    def info(self) -> Any:
        return None

    def add_wire_request(self, request_id: str, request: Any) -> None:
        self.waiting.append(request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting)

    def step(self) -> list[StageOutput]:
        self.is_stepping = True
        time.sleep(self.step_s)
        self.is_stepping = False
        done, self.waiting = self.waiting, []
        return [StageOutput(rid, finished=True, finish_reason="stop") for rid in done]

    def shutdown(self) -> None:
        self.shut_down_mid_step = self.is_stepping


def slow_client(step_s: float) -> tuple[StageClient, SlowEngine]:
    engine = SlowEngine(step_s)
    config = StageConfig(stage_id=0, kind="diffusion", model="unused")
    client = StageClient(config, InProcessLauncher({0: engine}))
    client.start()
    client.wait_ready()
    return client, engine


async def test_shutdown_never_frees_the_engine_under_a_running_step():
    client, engine = slow_client(step_s=0.5)
    client.add_request("r", DiffusionStageRequest(prompt="x"))
    await asyncio.sleep(0.1)  # the step is running
    client._handle.shutdown(timeout_s=0.05)
    deadline = time.monotonic() + 5
    while engine.shut_down_mid_step is None and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    assert engine.shut_down_mid_step is False


async def test_requests_after_shutdown_fail_instead_of_waiting_forever():
    client, _ = slow_client(step_s=0.0)
    client.shutdown()
    with pytest.raises(StageDeadError):
        client.add_request("late", DiffusionStageRequest(prompt="x"))


async def test_deepening_a_kept_sleep_with_wait_does_not_drain_or_resume(client):
    q = client.add_request("kept", ar_request(max_tokens=40, ignore_eos=True))
    await asyncio.wait_for(q.get(), 30)  # it is running
    (first,) = await client.call(ops.Sleep(level=1, mode="keep"))
    assert first.metadata.preempted >= 1
    (deeper,) = await asyncio.wait_for(
        client.call(ops.Sleep(level=2, mode="wait", drain_timeout_s=30)), 5
    )
    assert deeper.status == "SUCCESS" and deeper.metadata.mode == "keep"
    status = await client.call(ops.Status())
    assert status["is_sleeping"] and status["pause_mode"] == "keep"
    await client.call(ops.WakeUp())
    await client.call(ops.Resume())
    assert (await drain(q))[-1].finish_reason == "length"
