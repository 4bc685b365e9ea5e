"""Stage processes: death detection, isolation, clean shutdown; diffusion-only wake."""

import asyncio
import os
import signal
import threading
import time

import psutil
import pytest

from omnistage.engine.async_omni import AsyncOmni
from omnistage.errors import StageDeadError
from omnistage.stage import control as ops
from omnistage.stage.diffusion.wire import DiffusionStageRequest
from tests.integration.helpers import collect


async def test_killed_stage_is_detected_and_others_keep_serving():
    engine = AsyncOmni.from_pipeline("tiny-omni", enable_sleep_mode=True)
    children = [c.pid for c in engine.clients]
    try:
        victim = engine.clients[1].pid
        os.kill(victim, signal.SIGKILL)
        start = time.monotonic()
        while 1 not in engine.dead_stage_ids():
            await asyncio.sleep(0.05)
            assert time.monotonic() - start < 2.0, "stage death not noticed within 2 s"
        with pytest.raises(StageDeadError):
            await collect(engine, "draw", ["text", "image"])
        assert (await collect(engine, "text only", ["text"])).token_ids
    finally:
        engine.shutdown()
    assert not [
        pid
        for pid in children
        if psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    ]


async def test_diffusion_only_pipeline_serves_right_after_wake():
    engine = AsyncOmni.from_pipeline("tiny-image", enable_sleep_mode=True)
    try:
        before = await collect(engine, "a cat", ["image"])
        await engine.sleep([0], level=2)
        await engine.wake_up([0])
        assert not engine.is_paused(0)
        after = await collect(engine, "a cat", ["image"])
        assert after.pngs == before.pngs
    finally:
        engine.shutdown()


async def test_request_in_flight_on_a_dying_stage_fails_with_stage_dead():
    engine = AsyncOmni.from_pipeline("tiny-chat")
    try:
        started = asyncio.Event()
        sampling = {"temperature": 0.0, "max_tokens": 400, "ignore_eos": True}
        task = asyncio.ensure_future(collect(engine, "go", ["text"], sampling, started=started))
        await asyncio.wait_for(started.wait(), 30)
        os.kill(engine.clients[0].pid, signal.SIGKILL)
        with pytest.raises(StageDeadError, match="stage 0 process is dead"):
            await asyncio.wait_for(task, 10)
    finally:
        engine.shutdown()


async def test_sending_to_a_stage_that_just_died_does_not_block():
    engine = AsyncOmni.from_pipeline("tiny-chat")
    client = engine.clients[0]
    try:
        await client.call(ops.Status())  # bound to this loop
        os.kill(client.pid, signal.SIGKILL)
        client._handle.process.join(5)
        time.sleep(0.3)  # blocking on purpose: the loop has not been told of the death yet
        sender = threading.Thread(target=client.abort, args=(["ghost"],), daemon=True)
        sender.start()
        sender.join(2)
        assert not sender.is_alive(), "a send to a dead stage blocked its caller"
        with pytest.raises(StageDeadError):
            client.add_request("late", DiffusionStageRequest(prompt="x"))
    finally:
        engine.shutdown()
