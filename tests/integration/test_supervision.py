"""A stage whose process dies comes back as it was, while the others keep serving.

One tiny-omni pipeline (real stage processes) is shared by the module; each test kills a
stage with SIGKILL and waits for the supervisor to bring it back.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time

import psutil
import pytest
import pytest_asyncio
import torch

from omnistage.engine.async_omni import AsyncOmni
from omnistage.engine.supervisor import RestartPolicy
from omnistage.errors import StageDeadError, StageRestartingError
from tests.integration.helpers import GREEDY, collect, until

FAST = RestartPolicy(max_restarts=20, window_s=600, backoff_s=0.05, max_backoff_s=0.2)
LONG = {"temperature": 0.0, "max_tokens": 400, "ignore_eos": True}


@pytest_asyncio.fixture(scope="module")
async def omni():
    engine = AsyncOmni.from_pipeline(
        "tiny-omni", enable_sleep_mode=True, restart_policy=FAST, resume_after_wake=True
    )
    try:
        yield engine
    finally:
        engine.shutdown()


async def kill(omni: AsyncOmni, stage_id: int) -> int:
    """SIGKILL the stage's process; returns once the supervisor has it back (or fails)."""
    pid = omni.clients[stage_id].pid
    assert pid is not None
    restarts = omni.gate.stages[stage_id].restarts
    os.kill(pid, signal.SIGKILL)
    await until(lambda: omni.gate.stages[stage_id].restarts > restarts, 60, "restart")
    assert omni.clients[stage_id].pid != pid
    return pid


async def status(omni: AsyncOmni, stage_id: int) -> dict:
    return (await omni.stage_status())[stage_id]


@pytest.mark.parametrize("stage_id", [0, 1])
async def test_killed_under_load_fails_in_flight_fast_and_serves_the_same_again(omni, stage_id):
    modalities = ["text"] if stage_id == 0 else ["text", "image"]
    before = await collect(omni, "same answer", modalities)
    started = [asyncio.Event() for _ in range(4)]
    load = [
        asyncio.ensure_future(
            collect(omni, f"load {i}", ["text", "image"], LONG if stage_id == 0 else GREEDY,
                    started=started[i])
        )
        for i in range(4)
    ]  # fmt: skip
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 60)
    if stage_id == 1:  # wait until the image stage holds requests of its own
        await until(lambda: omni.clients[1].num_in_flight > 0, 60, "image requests in flight")
    pid = omni.clients[stage_id].pid
    os.kill(pid, signal.SIGKILL)
    start = time.monotonic()
    outcomes = await asyncio.gather(*load, return_exceptions=True)
    failed = [o for o in outcomes if isinstance(o, StageDeadError)]
    assert failed and time.monotonic() - start < 2.0
    assert "killed by SIGKILL" in str(failed[0])
    # The stage comes back: its requests say so (HTTP 503 stage_restarting, Retry-After).
    assert all(isinstance(o, StageRestartingError) and o.retry_after for o in failed)
    await until(lambda: omni.gate.stages[stage_id].state == "awake", 60, "stage back")
    after = await collect(omni, "same answer", modalities)
    assert after.token_ids == before.token_ids and after.pngs == before.pngs
    info = await status(omni, stage_id)
    assert info["restarts"] >= 1 and "SIGKILL" in info["last_exit"] and info["pid"] != pid


async def test_other_stages_serve_while_one_restarts(omni):
    pid = omni.clients[1].pid
    slow = FAST.backoff_s
    os.kill(pid, signal.SIGKILL)
    await until(lambda: 1 in omni.dead_stage_ids(), 2, "death noticed")
    assert omni.restarting_stage_ids() == [1]
    assert (await collect(omni, "text only", ["text"])).token_ids
    await until(lambda: omni.gate.stages[1].state == "awake", 60, "stage back")
    assert slow  # the restart waited its backoff, then came back


@pytest.mark.parametrize("level", [1, 2])
async def test_a_stage_killed_asleep_comes_back_asleep_at_its_level(omni, level):
    before = await collect(omni, "asleep and killed", ["text", "image"])
    await omni.sleep([0, 1], level=level)
    await kill(omni, 1)
    info = await status(omni, 1)
    assert info["state"] == "asleep" and info["level"] == level and info["is_sleeping"]
    if level == 2:  # nothing was loaded that the operator released
        assert not info["weights_valid"]
        assert info["memory"]["tags"]["weights"]["resident_bytes"] == 0
    assert omni.sleeping_stage_ids() == {0, 1}
    await omni.wake_up([0, 1])
    after = await collect(omni, "asleep and killed", ["text", "image"])
    assert after.token_ids == before.token_ids and after.pngs == before.pngs


async def test_a_stage_killed_during_a_sleep_comes_back_asleep_at_the_target_level(omni):
    before = await collect(omni, "killed mid-sleep", ["text"])
    started = asyncio.Event()
    running = asyncio.ensure_future(collect(omni, "drain me", ["text"], LONG, started=started))
    await asyncio.wait_for(started.wait(), 30)
    sleep = asyncio.ensure_future(omni.sleep([0], level=2, mode="wait"))
    await until(lambda: omni.gate.stages[0].state == "sleeping", 10, "sleep under way")
    await asyncio.sleep(0.2)  # the stage is draining the running request
    os.kill(omni.clients[0].pid, signal.SIGKILL)
    with pytest.raises(StageDeadError):
        await sleep
    with pytest.raises(StageDeadError):
        await running
    await until(lambda: omni.gate.stages[0].state == "asleep", 60, "back asleep")
    assert omni.gate.stages[0].level == 2
    await omni.wake_up([0])
    assert (await collect(omni, "killed mid-sleep", ["text"])).token_ids == before.token_ids


async def test_weight_updates_survive_a_restart(omni, tmp_path):
    from safetensors.torch import save_file

    from omnistage.models.loader import SafetensorsFile

    model_dir = omni.config.stages[0].model
    with SafetensorsFile(f"{model_dir}/model.safetensors") as st:
        name = next(k for k in st.keys() if k.endswith("mlp.down_proj.weight"))  # noqa: SIM118
        weight = st.tensor(name)
        generator = torch.Generator().manual_seed(0)
        update = {name: torch.randn(weight.shape, generator=generator, dtype=weight.dtype)}
    save_file(update, tmp_path / "update.safetensors")
    before = await collect(omni, "updated weights", ["text"])
    (ack,) = await omni.update_weights(0, str(tmp_path / "update.safetensors"))
    assert ack["status"] == "SUCCESS"
    updated = await collect(omni, "updated weights", ["text"])
    await kill(omni, 0)
    await until(lambda: omni.gate.stages[0].state == "awake", 60, "stage back")
    assert (await collect(omni, "updated weights", ["text"])).token_ids == updated.token_ids
    assert updated.token_ids != before.token_ids  # the update did change the model


async def test_out_of_restarts_a_stage_stays_dead_and_leaves_no_process():
    engine = AsyncOmni.from_pipeline(
        "tiny-chat", restart_policy=RestartPolicy(max_restarts=1, backoff_s=0.05)
    )
    pids: list[int] = []
    try:
        assert (await collect(engine, "hi", ["text"])).token_ids
        for attempt in range(2):
            started = asyncio.Event()
            running = asyncio.ensure_future(
                collect(engine, "cut short", ["text"], LONG, started=started)
            )
            await asyncio.wait_for(started.wait(), 30)
            pids.append(engine.clients[0].pid)
            os.kill(pids[-1], signal.SIGKILL)
            cut = (await asyncio.gather(running, return_exceptions=True))[0]
            # The first death is restarted (retry later); the second is final.
            assert isinstance(cut, StageDeadError)
            assert isinstance(cut, StageRestartingError) == (attempt == 0), cut
            await until(lambda: 0 in engine.dead_stage_ids(), 2, "death noticed")
            await until(lambda: engine.gate.stages[0].state != "restarting", 60, "settled")
        assert engine.gate.stages[0].state == "dead" and engine.gate.stages[0].restarts == 1
        with pytest.raises(StageDeadError):
            await collect(engine, "hi", ["text"])
        pids.append(engine.clients[0].pid)
    finally:
        engine.shutdown()
    alive = [p for p in pids if p and psutil.pid_exists(p)]
    assert all(psutil.Process(p).status() == psutil.STATUS_ZOMBIE for p in alive)
