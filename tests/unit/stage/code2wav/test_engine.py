"""The code2wav engine: interleaved jobs, each bit-identical to itself alone, and the same
control as every step-scheduled stage (pause, sleep, wake, weights)."""

import subprocess
import sys

import pytest
import torch
from safetensors.torch import save_file

from omnistage.errors import InvalidRequestError, StageAsleepError, WeightsInvalidError
from omnistage.stage.code2wav.engine import Code2WavStageEngine
from omnistage.stage.code2wav.params import Code2WavParams
from omnistage.stage.code2wav.request import Code2WavRequest
from omnistage.stage.code2wav.wire import Code2WavStageInfo, Code2WavStageRequest
from omnistage.stage.core import to_output_message
from omnistage.stage.diffusion.wire import DiffusionStageRequest
from tests.unit.stage.code2wav.conftest import (
    code2wav_config,
    codes_of,
    run_all,
    samples_of,
    step_until_output,
)

PARAMS = Code2WavParams(seed=7, num_steps=4)
CODES = codes_of(10, 0)


@pytest.fixture(scope="module")
def engine(omni_folder):
    engine = Code2WavStageEngine(code2wav_config(omni_folder))
    yield engine
    engine.shutdown()


def one(engine, request_id: str, codes=CODES, params=PARAMS) -> torch.Tensor:
    outputs = run_all(engine, [Code2WavRequest(request_id, codes, params)])
    return samples_of(outputs[request_id])


@pytest.fixture(scope="module")
def reference(engine):
    return one(engine, "ref")


def test_output_is_audio_with_its_seed_and_voice(engine, reference):
    out = run_all(engine, [Code2WavRequest("a", CODES, PARAMS)])["a"]
    audio = out.media[0]
    assert out.finished and out.finish_reason == "stop" and out.queue_time_s is not None
    assert (audio.voice, audio.seed, audio.sample_rate) == ("Chelsie", 7, 24000)
    assert torch.equal(audio.samples, reference)
    message = to_output_message(out)  # what the stage sends
    assert message.media[0].samples is audio.samples and len(message.media) == 1


def test_a_request_without_seed_reports_the_one_it_drew(engine):
    out = run_all(engine, [Code2WavRequest("s", CODES, Code2WavParams(num_steps=3))])["s"]
    seed = out.media[0].seed
    assert isinstance(seed, int)
    again = one(engine, "s2", params=Code2WavParams(num_steps=3, seed=seed))
    assert torch.equal(again, samples_of(out))


def test_eight_concurrent_requests_each_equal_alone(engine):
    requests = [
        Code2WavRequest(
            f"c{i}",
            codes_of(3 + 4 * i, i),
            Code2WavParams(
                seed=100 + i,
                num_steps=2 + i % 3,
                voice=("Chelsie", "Ethan")[i % 2],
                guidance_scale=(0.5, 0.0, 1.5)[i % 3],
            ),
        )
        for i in range(8)
    ]
    alone = {r.request_id: one(engine, r.request_id, r.codes, r.params) for r in requests}
    together = run_all(engine, requests)
    for request_id, samples in alone.items():
        assert torch.equal(samples_of(together[request_id]), samples), request_id
    assert engine.status()["num_running"] == 0


def test_a_short_request_is_not_held_behind_a_long_one(engine):
    engine.add_request(Code2WavRequest("long", codes_of(40, 1), Code2WavParams(num_steps=30)))
    engine.step()  # the long one is running
    engine.add_request(Code2WavRequest("short", codes_of(3, 2), Code2WavParams(num_steps=2)))
    assert [o.request_id for o in step_until_output(engine)] == ["short"]
    assert engine.status()["num_running"] == 1
    assert [o.request_id for o in step_until_output(engine)] == ["long"]


def test_an_aborted_request_leaves_at_the_next_step_and_others_are_untouched(engine, reference):
    engine.add_request(Code2WavRequest("x", codes_of(12, 3), PARAMS))
    engine.add_request(Code2WavRequest("y", CODES, PARAMS))
    for _ in range(3):
        engine.step()  # both are mid-way
    assert engine.status()["num_running"] == 2
    engine.abort("x")
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [("x", "abort")]
    outputs = {o.request_id: o for o in step_until_output(engine)}
    assert torch.equal(samples_of(outputs["y"]), reference)


@pytest.mark.parametrize("level", [1, 2])
def test_same_audio_after_sleep_and_wake(engine, reference, level):
    ack = engine.sleep(level=level)
    assert ack.status == "SUCCESS" and ack.metadata.level == level and engine.is_sleeping()
    assert engine.status()["memory"]["resident_bytes"] == 0
    with pytest.raises(StageAsleepError):
        engine.add_request(Code2WavRequest("asleep", CODES, PARAMS))
    wake = engine.wake_up()
    assert wake.status == "SUCCESS" and not engine.is_sleeping() and not engine.is_paused
    assert torch.equal(one(engine, f"after-{level}"), reference)


def test_a_kept_job_continues_after_a_level2_sleep_with_the_same_audio(engine, reference):
    engine.add_request(Code2WavRequest("kept", CODES, PARAMS))
    engine.step()
    engine.step()  # mid-way
    ack = engine.sleep(level=2, mode="keep")
    assert ack.status == "SUCCESS" and ack.metadata.aborted == 0
    assert engine.step() == [] and engine.status()["num_running"] == 1
    engine.wake_up()
    assert torch.equal(samples_of(step_until_output(engine)[0]), reference)


def test_sleep_abort_ends_running_and_queued_requests(engine):
    engine.add_request(Code2WavRequest("r1", CODES, PARAMS))
    engine.step()
    engine.add_request(Code2WavRequest("r2", CODES, PARAMS))
    ack = engine.sleep(level=1)
    assert ack.metadata.aborted == 2
    assert sorted((o.request_id, o.finish_reason) for o in engine.step()) == [
        ("r1", "abort"),
        ("r2", "abort"),
    ]
    engine.wake_up()


def test_pause_wait_drains_old_requests_and_holds_new_ones(engine):
    engine.add_request(Code2WavRequest("old", CODES, PARAMS))
    engine.pause("wait")
    engine.add_request(Code2WavRequest("new", CODES, PARAMS))
    assert not engine.is_drained()
    assert [o.request_id for o in step_until_output(engine)] == ["old"]
    assert engine.is_drained() and engine.step() == []
    engine.resume()
    assert [o.request_id for o in step_until_output(engine)] == ["new"]


def test_discarded_weights_refuse_until_updated(engine, omni_folder, reference):
    engine.sleep(level=2)
    engine.wake_up(reload=False)
    with pytest.raises(WeightsInvalidError):
        engine.add_request(Code2WavRequest("w", CODES, PARAMS))
    ack = engine.update_weights(omni_folder)
    assert ack.status == "SUCCESS" and engine.status()["weights_valid"]
    assert torch.equal(one(engine, "updated"), reference)


def test_update_weights_from_a_file_of_token2wav_names(engine, reference, tmp_path):
    targets = engine.worker.weight_targets()
    name = "token2wav.code2wav_dit_model.proj_out.weight"
    assert all(n.startswith("token2wav.code2wav_") for n in targets)
    update = tmp_path / "update.safetensors"
    changed = targets[name].clone() * 0.5
    save_file({name: changed, "thinker.lm_head.weight": torch.zeros(2, 2)}, str(update))
    assert engine.update_weights(update).status == "SUCCESS"
    assert not torch.equal(one(engine, "halved"), reference)
    bad = tmp_path / "bad.safetensors"
    save_file({"token2wav.code2wav_dit_model.nope": torch.zeros(2)}, str(bad))
    with pytest.raises(InvalidRequestError, match="nope"):
        engine.update_weights(bad)
    # a level-2 sleep replays the checkpoint, then the update: the halved weights come back
    halved = one(engine, "halved-again")
    engine.sleep(level=2)
    engine.wake_up()
    assert torch.equal(one(engine, "replayed"), halved)
    save_file({name: targets[name].clone() * 2.0}, str(update))
    engine.update_weights(update)
    assert torch.equal(one(engine, "restored"), reference)


def test_bad_and_duplicate_requests_are_refused_naming_the_field(engine):
    cases = [
        (Code2WavRequest("v", CODES, Code2WavParams(voice="Nobody")), "voice"),
        (Code2WavRequest("c", [0, 100_000], PARAMS), "codes"),
        (Code2WavRequest("e", [], PARAMS), "codes"),
        (Code2WavRequest("", CODES, PARAMS), "request_id"),
    ]
    for request, field in cases:
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request(request)
        assert info.value.field == field
    engine.pause("keep")
    engine.add_request(Code2WavRequest("dup", CODES, PARAMS))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_wire_request("dup", Code2WavStageRequest(codes=CODES, params=PARAMS))
    assert info.value.field == "request_id"
    with pytest.raises(InvalidRequestError) as info:
        engine.add_wire_request("d", DiffusionStageRequest(prompt="a"))
    assert info.value.field == "request"
    engine.abort("dup")
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [("dup", "abort")]
    engine.resume()


def test_status_and_info(engine):
    status = engine.status()
    assert status["kind"] == "code2wav" and status["weights_valid"] and not status["is_paused"]
    assert status["voices"] == ["Chelsie", "Ethan"] and status["default_voice"] == "Chelsie"
    assert status["sample_rate"] == 24000 and status["num_waiting"] == 0
    assert status["memory"]["reserved_bytes"] >= status["weight_bytes"] > 0
    assert status["num_requests_started"] >= 1 and status["num_synthesis_steps"] >= 1
    info = engine.info()
    assert isinstance(info, Code2WavStageInfo) and info.limits == engine.limits
    assert info.limits.codebook_size == engine.vocoder.dit.config.num_embeds


def test_the_stage_process_imports_no_diffusers(omni_folder):
    script = (
        "import sys\n"
        "from omnistage.config import StageConfig\n"
        "from omnistage.stage.kinds import stage_kind\n"
        f"config = StageConfig(stage_id=0, kind='code2wav', model={str(omni_folder)!r})\n"
        "engine = stage_kind('code2wav').build_engine(config)\n"
        "assert engine.info().limits.voices, 'no voices'\n"
        "engine.shutdown()\n"
        "assert 'diffusers' not in sys.modules, 'diffusers was imported'\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_utterances_of_one_length_share_forwards_and_each_equals_itself_alone(engine):
    requests = [
        Code2WavRequest(
            f"b{i}",
            codes_of(12, 20 + i),
            Code2WavParams(
                seed=200 + i,
                num_steps=3 + i % 2,  # rows at other time points share a forward too
                voice=("Chelsie", "Ethan")[i % 2],
                guidance_scale=(0.5, 1.5, 0.0)[i % 3],  # unguided ones step alone
            ),
        )
        for i in range(6)
    ]
    alone = {r.request_id: one(engine, r.request_id, r.codes, r.params) for r in requests}
    batched = engine.num_batched_steps
    together = run_all(engine, requests)
    assert engine.num_batched_steps > batched
    for request_id, samples in alone.items():
        assert torch.equal(samples_of(together[request_id]), samples), request_id


def fail_beside(engine, ok: str, bad: str, error: Exception) -> dict:
    """Run a request ``ok`` beside one ``bad`` whose job raises ``error`` at its next step."""
    engine.add_request(Code2WavRequest(ok, CODES, PARAMS))
    engine.add_request(Code2WavRequest(bad, codes_of(14, 5), PARAMS))
    engine.step()
    engine.step()  # both started
    job = next(job for job in engine._jobs if job.request_ids == [bad])
    job.advance = lambda: (_ for _ in ()).throw(error)
    return run_all(engine, [])


def test_two_step_threads_step_two_groups_at_once_each_utterance_as_alone(engine, omni_folder):
    threaded = Code2WavStageEngine(code2wav_config(omni_folder, step_threads=2, max_num_seqs=8))
    try:
        requests = [
            Code2WavRequest(
                f"t{i}",
                codes_of(12 if i < 4 else 5 + i, 30 + i),
                Code2WavParams(seed=300 + i, num_steps=10, voice=("Chelsie", "Ethan")[i % 2]),
            )
            for i in range(6)
        ]
        alone = {r.request_id: one(engine, r.request_id, r.codes, r.params) for r in requests}
        for request in requests:
            threaded.add_request(request)
        for _ in range(len(requests)):
            threaded.step()  # one job starts per step; none is done before the last starts
        assert len(threaded._jobs) == len(requests)
        steps = threaded.num_steps
        threaded.step()
        assert threaded.num_steps == steps + 2  # two groups, on two threads
        together = run_all(threaded, [])
        for request_id, samples in alone.items():
            assert torch.equal(samples_of(together[request_id]), samples), request_id
        assert threaded.num_batched_steps > 0  # the four of one length still share forwards
        # a group that fails on its thread fails its own requests only
        outputs = fail_beside(threaded, "ok", "bad", RuntimeError("boom"))
        assert outputs["bad"].finish_reason == "error" and "boom" in str(outputs["bad"].error)
        assert torch.equal(samples_of(outputs["ok"]), one(engine, "ok2", CODES, PARAMS))
        # a process fault, on whichever thread its group ran, still ends the stage's loop
        with pytest.raises(MemoryError):
            fail_beside(threaded, "ok3", "oom", MemoryError("out of memory"))
    finally:
        threaded.shutdown()
