"""AsyncOmni over real stage processes running the tiny-omni pipeline."""

import asyncio

import pytest

from omnistage.engine.async_omni import AsyncOmni
from omnistage.errors import (
    InvalidRequestError,
    StageAsleepError,
    StageBusyError,
    WeightsInvalidError,
)
from tests.integration.helpers import collect


async def test_text_and_image_for_one_prompt(tiny_omni):
    result = await collect(tiny_omni, "a red square", ["text", "image"])
    assert result.text and result.token_ids
    assert len(result.pngs) == 1 and result.pngs[0].startswith(b"\x89PNG")
    assert result.finish_reason in ("stop", "length")


@pytest.mark.parametrize("level", [1, 2])
async def test_same_outputs_after_sleep_and_wake_of_both_stages(tiny_omni, level):
    before = await collect(tiny_omni, "hello thinker", ["text", "image"])
    acks = await tiny_omni.sleep([0, 1], level=level)
    assert [a["stage_id"] for a in acks] == [0, 1]
    assert all(a["status"] == "SUCCESS" for a in acks)
    assert all(a["freed_bytes"] > 0 for a in acks) or level == 1
    assert tiny_omni.sleeping_stage_ids() == {0, 1}
    wake = await tiny_omni.wake_up([0, 1])
    assert all(a["status"] == "SUCCESS" for a in wake)
    await tiny_omni.resume_generation([0])
    after = await collect(tiny_omni, "hello thinker", ["text", "image"])
    assert after.token_ids == before.token_ids
    assert after.pngs == before.pngs


async def test_text_keeps_working_while_image_stage_sleeps(tiny_omni):
    await tiny_omni.sleep([1], level=1)
    try:
        text = await collect(tiny_omni, "still here?", ["text"])
        assert text.token_ids
        with pytest.raises(StageAsleepError, match="stage 1"):
            await collect(tiny_omni, "draw", ["text", "image"])
    finally:
        await tiny_omni.wake_up([1])
    assert len((await collect(tiny_omni, "draw", ["text", "image"])).pngs) == 1


async def test_ar_stage_waits_for_resume_after_wake(tiny_omni):
    await tiny_omni.sleep([0], level=2)
    await tiny_omni.wake_up([0])
    assert tiny_omni.is_paused(0)
    pending = asyncio.ensure_future(collect(tiny_omni, "wait for me", ["text"]))
    await asyncio.sleep(0.5)
    assert not pending.done()
    await tiny_omni.resume_generation([0])
    result = await asyncio.wait_for(pending, 30)
    assert result.token_ids


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_sleep_with_requests_in_flight_ends_each_as_its_mode_promises(tiny_omni, mode):
    # long enough that all 16 are still decoding when the sleep lands
    sampling = {"temperature": 0.0, "max_tokens": 320, "ignore_eos": True}
    prompts = [f"request number {i}" for i in range(16)]
    reference = await asyncio.gather(*(collect(tiny_omni, p, ["text"], sampling) for p in prompts))
    started = [asyncio.Event() for _ in prompts]
    tasks = [
        asyncio.ensure_future(collect(tiny_omni, p, ["text"], sampling, started=e))
        for p, e in zip(prompts, started, strict=True)
    ]
    await asyncio.gather(*(e.wait() for e in started))
    acks = await tiny_omni.sleep([0], level=1, mode=mode)
    assert acks[0]["status"] == "SUCCESS" and acks[0]["metadata"]["mode"] == mode
    if mode == "keep":
        await asyncio.sleep(0.2)
        assert not any(t.done() for t in tasks)  # preempted, not ended
    await tiny_omni.wake_up([0])
    await tiny_omni.resume_generation([0])
    results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    reasons = [r.finish_reason for r in results]
    if mode == "abort":
        assert "abort" in reasons and acks[0]["metadata"]["aborted"] > 0
    else:
        assert reasons == ["length"] * 16
        assert [r.token_ids for r in results] == [r.token_ids for r in reference]
    if mode == "keep":
        assert acks[0]["metadata"]["preempted"] > 0


async def test_admission_race_loses_no_request(tiny_omni):
    sampling = {"temperature": 0.0, "max_tokens": 8}

    async def submit(i: int) -> str:
        try:
            result = await collect(tiny_omni, f"race {i}", ["text"], sampling)
        except StageAsleepError:
            return "rejected"
        return result.finish_reason or "none"

    tasks = [asyncio.ensure_future(submit(i)) for i in range(50)]
    await asyncio.sleep(0)  # some are mid-submit
    await tiny_omni.sleep([0], level=1, mode="abort")
    outcomes = await asyncio.wait_for(asyncio.gather(*tasks), 60)
    await tiny_omni.wake_up([0])
    await tiny_omni.resume_generation([0])
    assert len(outcomes) == 50
    assert set(outcomes) <= {"rejected", "abort", "stop", "length"}
    assert "none" not in outcomes


async def test_concurrent_sleeps_of_one_stage_conflict(tiny_omni):
    first = asyncio.ensure_future(tiny_omni.sleep([1], level=1))
    await asyncio.sleep(0)
    with pytest.raises(StageBusyError):
        await tiny_omni.sleep([1], level=1)
    assert (await first)[0]["status"] == "SUCCESS"
    repeat = await tiny_omni.sleep([1], level=1)
    assert repeat[0]["status"] == "SKIPPED"
    await tiny_omni.wake_up([1])
    again = await tiny_omni.wake_up([1])
    assert again[0]["status"] == "SKIPPED"


async def test_unknown_stage_id_names_the_range(tiny_omni):
    with pytest.raises(ValueError, match=r"0\.\.1"):
        await tiny_omni.sleep([5])


async def test_empty_tags_are_refused_before_anything_pauses(tiny_omni):
    with pytest.raises(InvalidRequestError) as info:
        await tiny_omni.sleep([0], level=1, tags=[])
    assert info.value.field == "tags"
    assert not tiny_omni.is_paused(0) and tiny_omni.sleeping_stage_ids() == set()


async def test_stage_status_reports_state_and_memory(tiny_omni):
    statuses = await tiny_omni.stage_status()
    assert [s["stage_id"] for s in statuses] == [0, 1]
    assert statuses[0]["kind"] == "ar" and statuses[1]["kind"] == "diffusion"
    assert all(s["state"] == "awake" for s in statuses)


async def test_a_request_the_stage_refuses_names_the_field(tiny_omni):
    with pytest.raises(InvalidRequestError) as info:
        await collect(tiny_omni, {"prompt_token_ids": [10**9]}, ["text"])
    assert info.value.field == "prompt"


async def test_an_integer_too_big_for_the_wire_is_refused_naming_the_field(tiny_omni):
    with pytest.raises(InvalidRequestError) as info:
        await collect(tiny_omni, "hi", ["text"], {"max_tokens": 10**20})
    assert info.value.field == "sampling_params.max_tokens"


@pytest.mark.parametrize("mode", ["abort", "wait", "keep"])
async def test_requests_on_their_way_to_a_sleeping_stage_follow_its_mode(tiny_omni, mode):
    """Text+image requests still in the thinker when the image stage goes to sleep."""
    sampling = {"temperature": 0.0, "max_tokens": 200, "ignore_eos": True}
    started = [asyncio.Event() for _ in range(4)]
    tasks = [
        asyncio.ensure_future(
            collect(tiny_omni, f"picture {i}", ["text", "image"], sampling, started=e)
        )
        for i, e in enumerate(started)
    ]
    await asyncio.gather(*(e.wait() for e in started))
    acks = await tiny_omni.sleep([1], level=1, mode=mode)
    assert acks[0]["status"] == "SUCCESS"
    if mode == "wait":  # the sleep let them through the decoder before it slept
        assert all(t.done() for t in tasks)
    if mode == "keep":
        await asyncio.sleep(0.3)
        assert not any(t.done() for t in tasks)  # waiting at the hand-off
    if mode == "abort":  # they reach the decoder while it sleeps
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
    await tiny_omni.wake_up([1])
    results = await asyncio.wait_for(asyncio.gather(*tasks), 120)
    if mode == "abort":
        assert {r.finish_reason for r in results} == {"abort"}
    else:
        assert all(len(r.pngs) == 1 for r in results)


async def test_a_fresh_in_process_pipeline_gives_the_same_outputs(tiny_omni):
    """Same seed → same text and PNG across engine instances (here: stage processes vs the
    in-process stage client variant)."""
    expected = await collect(tiny_omni, "same seed", ["text", "image"])
    other = AsyncOmni.from_pipeline("tiny-omni", enable_sleep_mode=True, in_process=True)
    try:
        got = await collect(other, "same seed", ["text", "image"])
    finally:
        other.shutdown()
    assert got.token_ids == expected.token_ids
    assert got.pngs == expected.pngs


async def test_stage_woken_without_weights_counts_as_sleeping_until_reloaded(tiny_omni):
    before = await collect(tiny_omni, "weights please", ["text"])
    await tiny_omni.sleep([0], level=2)
    await tiny_omni.wake_up([0], reload=False)
    await tiny_omni.resume_generation([0])
    assert 0 in tiny_omni.sleeping_stage_ids()
    with pytest.raises(WeightsInvalidError):
        await collect(tiny_omni, "weights please", ["text"])
    acks = await tiny_omni.wake_up([0])  # reload=True now reloads what is missing
    assert acks[0]["status"] == "SUCCESS" and acks[0]["metadata"]["weights_valid"] is True
    await tiny_omni.resume_generation([0])
    assert tiny_omni.sleeping_stage_ids() == set()
    assert (await collect(tiny_omni, "weights please", ["text"])).token_ids == before.token_ids


async def test_a_text_and_image_request_gives_the_same_png_under_any_load(tiny_omni):
    """The thinker's hidden states handed to the image stage do not depend on batch-mates."""
    image = {"seed": 4, "num_inference_steps": 4}
    alone = await collect(tiny_omni, "draw a quiet lake", ["text", "image"], image=image)
    texts = [
        collect(
            tiny_omni,
            "talk " * (1 + i % 9) + str(i),
            ["text"],
            {"temperature": 0.0, "max_tokens": 4 + i % 13},
        )
        for i in range(63)
    ]
    others = [
        collect(tiny_omni, f"another picture {i}", ["text", "image"], image={"seed": i})
        for i in range(3)
    ]
    target = collect(tiny_omni, "draw a quiet lake", ["text", "image"], image=image)
    loaded, *_ = await asyncio.gather(target, *texts, *others)
    assert loaded.token_ids == alone.token_ids
    assert loaded.pngs == alone.pngs


async def test_a_text_and_image_request_cut_by_keep_sleeps_gives_the_same_png(tiny_omni):
    """A sleep with mode keep preempts the thinker's request, which recomputes after the
    wake. It recomputes step by step (``SequenceState.rewind``), so the hidden states it hands the
    image stage are the same bit for bit, and so is the PNG (in one prefill they were not)."""
    image = {"seed": 5, "num_inference_steps": 4}
    sampling = {"temperature": 0.0, "max_tokens": 80, "ignore_eos": True}
    prompt = "a long walk by the sea"
    alone = await collect(tiny_omni, prompt, ["text", "image"], sampling, image=image)
    preempted = 0
    for _ in range(3):
        started = asyncio.Event()
        task = asyncio.ensure_future(
            collect(tiny_omni, prompt, ["text", "image"], sampling, image=image, started=started)
        )
        await asyncio.wait_for(started.wait(), 30)
        (ack,) = await tiny_omni.sleep([0], level=1, mode="keep")
        preempted += ack["metadata"]["preempted"]
        await tiny_omni.wake_up([0])
        await tiny_omni.resume_generation([0])
        cut = await task
        assert cut.token_ids == alone.token_ids
        assert cut.pngs == alone.pngs
    assert preempted >= 1  # the request really was cut and recomputed
