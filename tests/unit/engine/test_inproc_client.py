"""The stage client's in-process variant: the same StageCore loop on a thread, no sockets."""

import asyncio

import pytest
import pytest_asyncio

from omnistage.config import StageConfig
from omnistage.engine.stage_client import InProcStageClient
from omnistage.errors import InvalidRequestError
from omnistage.pipelines import cache_dir, ensure_models, load_pipeline


@pytest_asyncio.fixture(scope="module")
async def client():
    pipeline = load_pipeline("tiny-chat", enable_sleep_mode=True)
    ensure_models(pipeline)
    stage: StageConfig = pipeline.stages[0].model_copy(update={"drain_timeout_s": 0.5})
    c = InProcStageClient(stage)
    c.start()
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
    q = client.add_request(
        "r1", {"prompt": "hi", "sampling_params": {"temperature": 0.0, "max_tokens": 5}}
    )
    outputs = await drain(q)
    assert outputs[-1].finish_reason == "length"
    assert sum(len(o.new_token_ids) for o in outputs) == 5


async def test_bad_request_fails_with_the_field_named(client):
    q = client.add_request("bad", {"prompt": "hi", "sampling_params": {"temperature": -3}})
    (out,) = await drain(q)
    assert out.finish_reason == "error" and out.error_type == "InvalidRequestError"
    assert "temperature" in out.error


async def test_utility_errors_cross_as_data(client):
    with pytest.raises(InvalidRequestError) as info:
        await client.call("sleep", level=9)
    assert info.value.field == "level"
    with pytest.raises(InvalidRequestError, match="unknown utility"):
        await client.call("format_disk")


async def test_sleep_with_wait_replies_after_the_drain(client):
    q = client.add_request(
        "long",
        {
            "prompt": "go",
            "sampling_params": {"temperature": 0.0, "max_tokens": 24, "ignore_eos": True},
        },
    )
    ack = await client.call("sleep", level=1, mode="wait", drain_timeout_s=60)
    assert q.qsize() > 0  # the request's outputs arrived before the reply
    outputs = []
    while not q.empty():
        outputs.append(q.get_nowait())
    assert outputs[-1].finished and outputs[-1].finish_reason == "length"
    assert ack["status"] == "SUCCESS" and ack["metadata"]["mode"] == "wait"
    await client.call("wake_up")
    await client.call("resume")


async def test_wait_drain_gives_up_after_the_timeout_and_resumes(client):
    q = client.add_request(
        "slow",
        {
            "prompt": "go",
            "sampling_params": {"temperature": 0.0, "max_tokens": 400, "ignore_eos": True},
        },
    )
    with pytest.raises(TimeoutError, match="drain_timeout_s"):
        await client.call("sleep", level=1, mode="wait", drain_timeout_s=0.05)
    status = await client.call("status")
    assert not status["is_sleeping"]
    client.abort(["slow"])
    assert (await drain(q))[-1].finish_reason == "abort"


def test_cache_dir_is_the_test_cache():
    assert ".omnistage-cache" in str(cache_dir())
