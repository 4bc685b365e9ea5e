"""Auto-wake of parked stages and idle sleep, over real stage processes."""

import asyncio
import time

from omnistage.engine.async_omni import AsyncOmni
from omnistage.pipelines import load_pipeline
from tests.integration.helpers import collect


async def test_auto_wake_serves_a_request_for_a_parked_stage(tiny_omni):
    await tiny_omni.sleep([1], level=2)
    tiny_omni.autopilot.auto_wake = True
    try:
        results = await asyncio.gather(
            *(collect(tiny_omni, f"draw {i}", ["text", "image"]) for i in range(3))
        )
    finally:
        tiny_omni.autopilot.auto_wake = False
    assert all(len(r.pngs) == 1 for r in results)
    assert tiny_omni.sleeping_stage_ids() == set()


async def test_idle_stage_is_parked_and_woken_on_demand():
    config = load_pipeline("tiny-chat", enable_sleep_mode=True, idle_sleep_s=0.5)
    engine = AsyncOmni.from_config(config, auto_wake=True, resume_after_wake=True)
    try:
        engine.start_background_tasks()
        assert (await collect(engine, "hello", ["text"])).token_ids
        start = time.monotonic()
        while 0 not in engine.sleeping_stage_ids():
            assert time.monotonic() - start < 5, "idle stage was not parked"
            await asyncio.sleep(0.1)
        result = await collect(engine, "hello again", ["text"])
        assert result.token_ids and result.finish_reason in ("stop", "length")
    finally:
        engine.shutdown()
