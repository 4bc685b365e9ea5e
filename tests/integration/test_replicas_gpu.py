"""CUDA-only: two replicas of an AR stage sharing one device (``replica_devices: [cuda:0,
cuda:0]``, ``gpu_memory_utilization`` 0.2 each) serve requests as one does, greedy tokens
equal to each alone; one replica's level-1 sleep gives its device memory back (its ACK's
freed bytes, its status) while the other serves on, and its wake brings it back serving."""

from __future__ import annotations

import asyncio

import pytest
import torch

from omnistage.config import StageConfig
from omnistage.engine.async_omni import AsyncOmni
from omnistage.pipelines import load_pipeline
from tests.integration.helpers import collect

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


async def test_two_replicas_on_one_device_serve_sleep_and_wake_apart():
    pipeline = load_pipeline("tiny-chat", device="cuda:0", enable_sleep_mode=True)
    data = pipeline.stages[0].model_dump()
    data["ar"].update(gpu_memory_utilization=0.2, kv_cache_memory=None)
    data.update(replicas=2, replica_devices=["cuda:0", "cuda:0"])  # 0.4 of the device in all
    stage = StageConfig.model_validate(data)
    omni = AsyncOmni.from_config(pipeline.model_copy(update={"stages": [stage]}))
    try:
        prompts = [f"count to {i}" for i in range(6)]
        alone = [(await collect(omni, p, ["text"])).token_ids for p in prompts]
        together = await asyncio.gather(
            *(collect(omni, p, ["text"], request_id=f"g{i}") for i, p in enumerate(prompts))
        )
        assert [r.token_ids for r in together] == alone
        assert {omni.clients[0].placed(f"g{i}") for i in range(6)} == {0, 1}
        acks = await omni.sleep([0], level=1, replica_ids=[1])
        assert acks[0]["replica_id"] == 1 and acks[0]["freed_bytes"] > 0
        (status,) = await omni.stage_status()
        assert [r["state"] for r in status["replicas"]] == ["awake", "asleep"]
        assert (await collect(omni, prompts[0], ["text"])).token_ids == alone[0]
        await omni.wake_up([0], replica_ids=[1])
        together = await asyncio.gather(*(collect(omni, p, ["text"]) for p in prompts))
        assert [r.token_ids for r in together] == alone
    finally:
        omni.shutdown()
