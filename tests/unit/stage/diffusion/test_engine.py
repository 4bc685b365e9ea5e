import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from omnistage.errors import (
    InvalidRequestError,
    SleepModeDisabledError,
    StageAsleepError,
    WeightsInvalidError,
)
from omnistage.stage.diffusion.engine import DiffusionStageEngine
from omnistage.stage.diffusion.params import DiffusionParams, DiffusionRequest
from tests.unit.stage.diffusion.conftest import (
    diffusion_config,
    png_of,
    run_all,
    step_until_output,
)

PARAMS = DiffusionParams(seed=11, num_inference_steps=4)


@pytest.fixture(scope="module")
def engine(image_folder):
    engine = DiffusionStageEngine(diffusion_config(image_folder, max_batch_size=4))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def reference_png(engine):
    return png_of(
        run_all(engine, [DiffusionRequest("ref", prompt="a red cat", params=PARAMS)])["ref"]
    )


def one_png(engine, request_id: str, prompt: str = "a red cat", params=PARAMS) -> bytes:
    return png_of(
        run_all(engine, [DiffusionRequest(request_id, prompt=prompt, params=params)])[request_id]
    )


def test_output_is_a_png_of_the_native_size(engine, reference_png):
    out = run_all(engine, [DiffusionRequest("size", prompt="a red cat", params=PARAMS)])["size"]
    image = out.media[0]
    assert out.finished and out.finish_reason == "stop"
    assert reference_png.startswith(b"\x89PNG") and (image.width, image.height, image.seed) == (
        64,
        64,
        11,
    )


def test_different_prompts_and_seeds_give_different_images(engine, reference_png):
    assert one_png(engine, "p", prompt="a blue dog") != reference_png
    assert (
        one_png(engine, "s", params=DiffusionParams(seed=12, num_inference_steps=4))
        != reference_png
    )


@pytest.mark.parametrize("level", [1, 2])
def test_same_png_after_sleep_and_wake(engine, reference_png, level):
    ack = engine.sleep(level=level)
    assert ack.status == "SUCCESS" and ack.metadata.level == level
    assert engine.is_sleeping()
    with pytest.raises(StageAsleepError):
        engine.add_request(DiffusionRequest("asleep", prompt="a red cat", params=PARAMS))
    wake = engine.wake_up()
    assert wake.status == "SUCCESS" and not engine.is_sleeping() and not engine.is_paused
    assert one_png(engine, f"after-{level}") == reference_png


def test_batch_of_four_matches_each_alone_and_runs_once(engine):
    requests = [
        DiffusionRequest(
            f"b{i}",
            prompt=p,
            params=DiffusionParams(seed=i, num_inference_steps=4, guidance_scale=g),
        )
        for i, (p, g) in enumerate(
            [("a red cat", 3.0), ("dog", 3.0), ("x", 4.5), ("sunset over sea", 2.0)]
        )
    ]
    alone = {r.request_id: png_of(run_all(engine, [r])[r.request_id]) for r in requests}
    batches_before = engine.num_batches
    together = run_all(engine, requests)
    assert engine.num_batches == batches_before + 1 and engine.last_batch_size == 4
    assert {rid: png_of(out) for rid, out in together.items()} == alone


def test_incompatible_requests_run_in_separate_batches(engine):
    requests = [
        DiffusionRequest("s64", prompt="a", params=DiffusionParams(seed=1, num_inference_steps=2)),
        DiffusionRequest(
            "s32", prompt="a", params=DiffusionParams(seed=1, num_inference_steps=2, height=32)
        ),
        DiffusionRequest("s64b", prompt="b", params=DiffusionParams(seed=2, num_inference_steps=2)),
    ]
    before = engine.num_batches
    outputs = run_all(engine, requests)
    assert engine.num_batches == before + 2
    assert outputs["s32"].media[0].height == 32


def test_ddim_is_selectable(engine, reference_png):
    ddim = DiffusionParams(seed=11, num_inference_steps=4, scheduler="ddim")
    assert one_png(engine, "ddim", params=ddim) != reference_png


def test_discarded_weights_refuse_until_updated(engine, image_folder, reference_png, tmp_path):
    engine.sleep(level=2)
    ack = engine.wake_up(reload=False)
    assert ack.metadata.weights_valid is False
    with pytest.raises(WeightsInvalidError, match="update_weights"):
        engine.add_request(DiffusionRequest("garbage", prompt="a red cat", params=PARAMS))
    assert engine.step() == []  # nothing runs on discarded weights
    engine.update_weights(image_folder)
    assert one_png(engine, "restored") == reference_png


def test_update_weights_from_prefixed_file_changes_images_like_a_fresh_load(
    engine, image_folder, reference_png, tmp_path
):
    module = engine.pipeline.modules["transformer"]
    changed = {
        f"transformer.{name}": tensor.detach().clone() * 1.5
        for name, tensor in module.state_dict().items()
        if name.startswith("proj_out")
    }
    update = tmp_path / "update.safetensors"
    save_file(changed, str(update))
    ack = engine.update_weights(update)
    assert ack.status == "SUCCESS"
    updated_png = one_png(engine, "updated")
    assert updated_png != reference_png
    # A level-2 cycle reloads the original checkpoint and then replays the update.
    engine.sleep(level=2)
    engine.wake_up()
    assert one_png(engine, "replayed") == updated_png
    engine.update_weights(image_folder)  # a full folder puts the original weights back
    assert one_png(engine, "original") == reference_png


def test_bad_weight_sources_leave_weights_untouched(engine, reference_png, tmp_path):
    bad = tmp_path / "bad.safetensors"
    save_file({"transformer.not_a_tensor": torch.zeros(2)}, str(bad))
    with pytest.raises(InvalidRequestError, match="not_a_tensor"):
        engine.update_weights(bad)
    save_file({"transformer.proj_out.weight": torch.zeros(3, 3)}, str(bad))
    with pytest.raises(InvalidRequestError, match="shape mismatch"):
        engine.update_weights(bad)
    assert one_png(engine, "untouched") == reference_png


def test_pause_abort_ends_waiting_requests(engine):
    engine.add_request(DiffusionRequest("w1", prompt="a", params=PARAMS))
    assert engine.pause("abort") == 1
    outputs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("w1", "abort")]
    engine.resume()


def test_pause_wait_drains_old_requests_and_holds_new_ones(engine):
    engine.add_request(DiffusionRequest("old", prompt="a", params=PARAMS))
    engine.pause("wait")
    engine.add_request(
        DiffusionRequest("new", prompt="b", params=DiffusionParams(seed=1, num_inference_steps=4))
    )
    assert not engine.is_drained()
    assert [o.request_id for o in step_until_output(engine)] == ["old"]
    assert engine.is_drained() and engine.step() == []
    engine.resume()
    assert [o.request_id for o in step_until_output(engine)] == ["new"]


def test_sleep_keep_holds_requests_until_wake(engine):
    engine.add_request(DiffusionRequest("kept", prompt="a", params=PARAMS))
    ack = engine.sleep(level=1, mode="keep")
    assert ack.metadata.mode == "keep" and ack.metadata.aborted == 0
    assert engine.step() == [] and engine.status()["num_waiting"] == 1
    engine.wake_up()
    assert [o.finish_reason for o in step_until_output(engine)] == ["stop"]


def test_sleep_wait_refuses_until_drained(engine):
    engine.add_request(DiffusionRequest("drain", prompt="a", params=PARAMS))
    with pytest.raises(RuntimeError, match="is_drained"):
        engine.sleep(level=1, mode="wait")
    step_until_output(engine)
    assert engine.sleep(level=1, mode="wait").status == "SUCCESS"
    engine.wake_up()


def test_level0_pauses_only_and_wake_resumes(engine):
    ack = engine.sleep(level=0)
    assert ack.status == "SUCCESS" and engine.is_sleeping() and engine.is_paused
    assert (
        engine.status()["memory"]["resident_bytes"] == engine.status()["memory"]["reserved_bytes"]
    )
    assert engine.wake_up().status == "SUCCESS"
    assert not engine.is_sleeping() and not engine.is_paused


def test_repeated_sleep_and_wake_are_skipped(engine):
    engine.sleep(level=1)
    assert engine.sleep(level=1).status == "SKIPPED"
    assert engine.wake_up().status == "SUCCESS"
    assert engine.wake_up().status == "SKIPPED"


def test_status_reports_state(engine):
    status = engine.status()
    assert status["kind"] == "diffusion" and status["weights_valid"] and not status["is_paused"]
    assert status["memory"]["reserved_bytes"] >= status["weight_bytes"] > 0


def test_duplicate_and_invalid_requests_are_refused(engine):
    engine.pause("keep")
    engine.add_request(DiffusionRequest("dup", prompt="a", params=PARAMS))
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(DiffusionRequest("dup", prompt="a", params=PARAMS))
    assert info.value.field == "request_id"
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request(DiffusionRequest("h", prompt="a", params=DiffusionParams(height=63)))
    assert info.value.field == "height"
    engine.abort("dup")
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [("dup", "abort")]
    engine.resume()


def test_embeddings_condition_the_cond_pipeline(image_cond_folder):
    engine = DiffusionStageEngine(diffusion_config(image_cond_folder, enable_sleep_mode=False))
    try:
        hidden = torch.randn(7, 256, generator=torch.Generator().manual_seed(0))
        params = DiffusionParams(seed=5, num_inference_steps=3, guidance_scale=2.0)
        requests = [
            DiffusionRequest("h1", prompt_embeds=hidden, params=params),
            DiffusionRequest("h2", prompt_embeds=hidden[:3], params=params),
        ]
        outputs = run_all(engine, requests)
        assert png_of(outputs["h1"]) != png_of(outputs["h2"])
        alone = run_all(
            engine, [DiffusionRequest("h2-alone", prompt_embeds=hidden[:3], params=params)]
        )
        assert png_of(alone["h2-alone"]) == png_of(outputs["h2"])  # padding does not leak
        with pytest.raises(InvalidRequestError, match="prompt_embeds"):
            engine.add_request(DiffusionRequest("t", prompt="text", params=params))
        with pytest.raises(SleepModeDisabledError):
            engine.sleep(level=1)
    finally:
        engine.shutdown()


def test_refused_sleep_does_not_touch_requests(engine):
    engine.add_request(DiffusionRequest("survivor", prompt="a", params=PARAMS))
    with pytest.raises(InvalidRequestError) as info:
        engine.sleep(level=1, tags=["kv_cache"])
    assert info.value.field == "tags" and not engine.is_paused
    with pytest.raises(InvalidRequestError) as info:
        engine.sleep(level=3)
    assert info.value.field == "level"
    assert [o.request_id for o in step_until_output(engine)] == ["survivor"]


def test_transformer_config_without_out_channels_runs(image_cond_folder, tmp_path):
    """diffusers stores ``out_channels: null`` when it defaults to ``in_channels``."""
    folder = tmp_path / "no-out-channels"
    shutil.copytree(image_cond_folder, folder)
    config_path = folder / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config["out_channels"] = None
    config_path.write_text(json.dumps(config))
    hidden = torch.randn(4, 256, generator=torch.Generator().manual_seed(0))
    request = DiffusionRequest("n", prompt_embeds=hidden, params=PARAMS)
    pngs = []
    for source in (image_cond_folder, folder):
        engine = DiffusionStageEngine(diffusion_config(source, enable_sleep_mode=False))
        try:
            pngs.append(png_of(run_all(engine, [request])["n"]))
        finally:
            engine.shutdown()
    assert pngs[0] == pngs[1]


def test_a_failed_build_frees_its_arena(image_cond_folder, tmp_path, monkeypatch):
    from omnistage.memory import Arena
    from omnistage.models.loader import CheckpointError
    from omnistage.stage import worker as worker_module

    folder = tmp_path / "dynamic-shift"
    shutil.copytree(image_cond_folder, folder)
    config_path = folder / "scheduler" / "scheduler_config.json"
    config = json.loads(config_path.read_text())
    config["use_dynamic_shifting"] = True
    config_path.write_text(json.dumps(config))
    closed_with_bytes: list[int] = []

    class RecordedArena(Arena):
        def close(self) -> None:
            closed_with_bytes.append(self.stats()["weights"].reserved_bytes)
            super().close()

    monkeypatch.setattr(worker_module, "Arena", RecordedArena)
    with pytest.raises(CheckpointError, match="use_dynamic_shifting"):
        DiffusionStageEngine(diffusion_config(folder))
    assert len(closed_with_bytes) == 1 and closed_with_bytes[0] > 0  # weights were adopted


def test_an_aborted_request_leaves_its_batch_at_the_next_step(engine):
    params = DiffusionParams(seed=2, num_inference_steps=6)
    alone = png_of(
        run_all(engine, [DiffusionRequest("b-alone", prompt="dog", params=params)])["b-alone"]
    )
    engine.add_request(DiffusionRequest("a", prompt="a red cat", params=params))
    engine.add_request(DiffusionRequest("b", prompt="dog", params=params))
    engine.step()
    engine.step()  # both are mid-way through one batch
    assert engine.status()["num_running"] == 2
    engine.abort("a")
    assert [(o.request_id, o.finish_reason) for o in engine.step()] == [("a", "abort")]
    outputs = {o.request_id: o for o in step_until_output(engine)}
    assert png_of(outputs["b"]) == alone  # the survivor's image is untouched


def test_a_small_request_is_not_held_behind_a_long_one(engine):
    engine.add_request(
        DiffusionRequest("long", prompt="a", params=DiffusionParams(seed=1, num_inference_steps=40))
    )
    engine.step()  # the long one is running
    engine.add_request(
        DiffusionRequest(
            "short", prompt="b", params=DiffusionParams(seed=1, num_inference_steps=2, height=32)
        )
    )
    finished = [o.request_id for o in step_until_output(engine)]
    assert finished == ["short"] and engine.status()["num_running"] == 1
    assert [o.request_id for o in step_until_output(engine)] == ["long"]


def test_a_kept_batch_continues_after_a_level2_sleep_with_the_same_image(engine, reference_png):
    engine.add_request(DiffusionRequest("kept-mid", prompt="a red cat", params=PARAMS))
    engine.step()
    engine.step()  # mid-way
    ack = engine.sleep(level=2, mode="keep")
    assert ack.status == "SUCCESS" and engine.step() == []
    engine.wake_up()
    assert png_of(step_until_output(engine)[0]) == reference_png


def test_a_request_waits_briefly_for_others_to_share_its_batch(image_folder):
    """Concurrent requests reach the stage a few ms apart: with ``batch_wait_ms`` the first
    holds its batch open for them instead of starting alone; a full batch starts at once."""
    waiting = DiffusionStageEngine(
        diffusion_config(image_folder, max_batch_size=2, batch_wait_ms=10_000)
    )
    try:
        waiting.add_request(DiffusionRequest("w1", prompt="a red cat", params=PARAMS))
        for _ in range(20):
            assert waiting.step() == []
        assert waiting.num_batches == 0  # still gathering
        waiting.add_request(DiffusionRequest("w2", prompt="dog", params=PARAMS))
        waiting.step()
        assert (waiting.num_batches, waiting.last_batch_size) == (1, 2)  # full: no wait
    finally:
        waiting.shutdown()


def test_two_step_threads_denoise_two_batches_at_once_each_image_as_alone(engine, image_folder):
    threaded = DiffusionStageEngine(diffusion_config(image_folder, step_threads=2))
    try:
        params = {
            "t64": DiffusionParams(seed=3, num_inference_steps=3),
            "t32": DiffusionParams(seed=4, num_inference_steps=3, height=32),
        }
        alone = {rid: one_png(engine, rid, "a dog", p) for rid, p in params.items()}
        for rid, p in params.items():
            threaded.add_request(DiffusionRequest(rid, prompt="a dog", params=p))
        outputs = threaded.step() + threaded.step()  # both batches started (one per step)
        steps = threaded.num_steps
        outputs += threaded.step()
        assert threaded.num_steps == steps + 2  # the two batches, on two threads
        together = {o.request_id: o for o in outputs if o.finished} | run_all(threaded, [])
        assert {rid: png_of(together[rid]) for rid in params} == alone
    finally:
        threaded.shutdown()
