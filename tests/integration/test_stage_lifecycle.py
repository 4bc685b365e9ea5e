"""Stage processes: death detection, isolation, clean shutdown; diffusion-only wake."""

import asyncio
import os
import signal
import time

import psutil
import pytest

from omnistage.engine.async_omni import AsyncOmni
from omnistage.errors import StageDeadError
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
