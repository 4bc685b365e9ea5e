import pytest
import torch

from omnistage import Diffusion, DiffusionParams, ImageOutput
from omnistage.errors import InvalidRequestError, StageAsleepError, WeightsInvalidError

PARAMS = DiffusionParams(seed=4, num_inference_steps=3)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from a second thread; on a busy machine it costs a lot."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    folder = tmp_path_factory.mktemp("image")
    with Diffusion(model=folder, preset="image", max_batch_size=2) as pipe:
        yield pipe


def test_generate_returns_pngs_in_input_order(pipe):
    images = pipe.generate(["a red cat", "a blue dog", "a red cat"], PARAMS)
    assert all(isinstance(i, ImageOutput) and i.png.startswith(b"\x89PNG") for i in images)
    assert (images[0].width, images[0].height) == (64, 64)
    assert images[0].png == images[2].png != images[1].png


def test_generate_accepts_embeddings_and_per_input_params(pipe):
    embeds = torch.randn(5, 256, generator=torch.Generator().manual_seed(1))
    params = [PARAMS, DiffusionParams(seed=4, num_inference_steps=3, height=32, return_pixels=True)]
    images = pipe.generate([embeds, "a cat"], params)
    assert (images[1].width, images[1].height) == (64, 32) and images[1].pixels is not None
    assert tuple(images[1].pixels.shape) == (32, 64, 3)  # [height, width, rgb]
    assert images[0].pixels is None


def test_bad_params_raise_before_anything_runs(pipe):
    with pytest.raises(InvalidRequestError) as info:
        pipe.generate(["a", "b"], [PARAMS, DiffusionParams(width=30)])
    assert info.value.field == "width"
    assert not pipe.engine.has_unfinished_requests()


def test_sleep_wake_cycle_keeps_images(pipe):
    before = pipe.generate("a red cat", PARAMS)[0].png
    pipe.sleep(level=2)
    assert pipe.is_sleeping() and pipe.memory_stats()["resident_bytes"] == 0
    with pytest.raises(StageAsleepError):
        pipe.generate("a red cat", PARAMS)
    pipe.wake_up(reload=False)
    with pytest.raises(WeightsInvalidError):
        pipe.generate("a red cat", PARAMS)
    pipe.update_weights(pipe.engine.pipeline.folder)
    assert not pipe.is_sleeping()
    assert pipe.generate("a red cat", PARAMS)[0].png == before


def test_unknown_keywords_are_named(tmp_path):
    with pytest.raises(TypeError, match="max_num_images"):
        Diffusion(model=tmp_path, max_num_images=3)


@pytest.mark.timeout(20)
def test_generate_at_level0_sleep_raises_instead_of_waiting_forever(pipe):
    pipe.sleep(level=0)
    try:
        with pytest.raises(StageAsleepError):
            pipe.generate("a red cat", PARAMS)
        assert not pipe.engine.has_unfinished_requests()
    finally:
        pipe.wake_up()


def test_a_failed_request_leaves_no_other_request_queued(pipe, monkeypatch):
    from omnistage.stage.diffusion.denoise import DenoiseJob

    real_advance = DenoiseJob.advance

    def fail_small_images(job):
        if job.height == 32:
            raise RuntimeError("boom")
        return real_advance(job)

    monkeypatch.setattr(DenoiseJob, "advance", fail_small_images)
    small = DiffusionParams(seed=4, num_inference_steps=3, height=32)
    with pytest.raises(RuntimeError, match="boom"):
        pipe.generate(["a red cat", "a blue dog"], [small, PARAMS])  # two batches
    assert not pipe.engine.has_unfinished_requests()
    assert len(pipe.generate("a red cat", PARAMS)) == 1
