"""A request's image does not depend on how many requests share its batch, bit for bit.

MKL runs in strict CNR mode (set by ``import omnistage``: see ``omnistage/batch_invariance.py``)
and ``F.linear`` pads its rows (``tests/unit/models/test_invariant_linear.py``), which makes GEMM
rows independent of the row count; ``batch_invariant_kernels`` switches oneDNN and NNPACK off
process-wide, and overlapping users must agree.
"""

import os
import subprocess
import sys
import threading

import pytest
import torch

from omnistage.batch_invariance import MKL_CBWR_ENV, STRICT_CNR, SWITCH_ENV, enable_strict_cnr
from omnistage.stage.diffusion.batch_invariance import batch_invariant_kernels
from omnistage.stage.diffusion.engine import DiffusionStageEngine
from omnistage.stage.diffusion.params import DiffusionParams, DiffusionRequest
from tests.unit.stage.diffusion.conftest import diffusion_config

CPU = torch.device("cpu")


def test_onednn_and_nnpack_are_off_inside_and_restored_after_an_exception():
    previous = torch.backends.mkldnn.enabled, torch._C._get_nnpack_enabled()
    try:
        with batch_invariant_kernels(CPU):
            assert not torch.backends.mkldnn.enabled and not torch._C._get_nnpack_enabled()
            raise KeyError("boom")
    except KeyError:
        pass
    assert (torch.backends.mkldnn.enabled, torch._C._get_nnpack_enabled()) == previous


def test_overlapping_blocks_on_two_threads_keep_onednn_off_and_restore_it():
    previous = torch.backends.mkldnn.enabled
    first_inside, second_inside, first_left = (threading.Event() for _ in range(3))
    seen: dict[str, bool] = {}

    def first() -> None:
        with batch_invariant_kernels(CPU):
            first_inside.set()
            second_inside.wait(timeout=5)
        first_left.set()

    def second() -> None:
        first_inside.wait()
        with batch_invariant_kernels(CPU):
            second_inside.set()
            first_left.wait(timeout=5)
            seen["enabled_inside"] = torch.backends.mkldnn.enabled

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    after = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = previous  # type: ignore[assignment]
    assert seen == {"enabled_inside": False}  # the second model still ran with oneDNN off
    assert after == previous


def test_strict_cnr_is_set_unless_mkl_cbwr_is_set_or_switched_off():
    fresh: dict[str, str] = {}
    assert enable_strict_cnr(fresh) and fresh == {MKL_CBWR_ENV: STRICT_CNR}
    own = {MKL_CBWR_ENV: "COMPATIBLE"}
    assert not enable_strict_cnr(own) and own == {MKL_CBWR_ENV: "COMPATIBLE"}
    for off in ("0", "false", "OFF"):
        switched_off = {SWITCH_ENV: off}
        assert not enable_strict_cnr(switched_off) and MKL_CBWR_ENV not in switched_off


@pytest.mark.skipif(not torch.backends.mkl.is_available(), reason="torch without MKL")
def test_mkl_runs_strict_after_importing_omnistage_after_torch():
    env = {k: v for k, v in os.environ.items() if k not in (MKL_CBWR_ENV, SWITCH_ENV)}
    code = "import torch, omnistage; torch.randn(3, 8) @ torch.randn(8, 8)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**env, "MKL_VERBOSE": "1"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "CNR:AUTO,STRICT" in done.stdout + done.stderr


@pytest.fixture(scope="module")
def engine(image_folder):
    engine = DiffusionStageEngine(diffusion_config(image_folder, max_batch_size=4))
    yield engine
    engine.shutdown()


def pixels_of(engine, requests) -> tuple[dict[str, torch.Tensor], int]:
    """Each request's float pixels, and the largest batch that ran."""
    for request in requests:
        engine.add_request(request)
    pixels: dict[str, torch.Tensor] = {}
    largest = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            assert output.finish_reason == "stop", output.error
            pixels[output.request_id] = output.media[0].pixels
        largest = max(largest, engine.last_batch_size)
    return pixels, largest


# Unguided: one denoiser row per request, so alone the patch embedding sees a batch of one
# (oneDNN's convolution rounds differently there); guided: two rows per request.
@pytest.mark.parametrize("guidance_scale", [1.0, 3.0])
def test_batch_of_four_gives_each_request_the_pixels_it_gets_alone(engine, guidance_scale):
    requests = [
        DiffusionRequest(
            f"r{i}",
            prompt=prompt,
            params=DiffusionParams(
                seed=i, num_inference_steps=3, guidance_scale=guidance_scale, return_pixels=True
            ),
        )
        for i, prompt in enumerate(["a red cat", "dog", "x", "sunset over sea"])
    ]
    alone = {}
    for request in requests:
        pixels, _ = pixels_of(engine, [request])
        alone.update(pixels)
    together, largest = pixels_of(engine, requests)
    assert largest == 4
    assert together.keys() == alone.keys()
    for request_id, image in together.items():
        assert torch.equal(image, alone[request_id]), request_id
