from pathlib import Path

import pytest
import torch

from omnistage.config import StageConfig


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from a second thread, and on a busy 2-core machine spinning
    OpenMP threads made them up to 50x slower."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def image_folder(tmp_path_factory) -> Path:
    from omnistage.models.tiny import build_preset

    return build_preset("image", tmp_path_factory.mktemp("image"))


@pytest.fixture(scope="session")
def image_cond_folder(tmp_path_factory) -> Path:
    from omnistage.models.tiny import build_preset

    return build_preset("image-cond", tmp_path_factory.mktemp("image-cond"))


def diffusion_config(folder: Path, **overrides) -> StageConfig:
    """A diffusion stage's config; requests start at once (no batch wait) unless asked: the
    tests step the engine in tight loops."""
    fields = {
        "stage_id": 1,
        "kind": "diffusion",
        "model": str(folder),
        "enable_sleep_mode": True,
        "batch_wait_ms": 0.0,
    }
    return StageConfig(**{**fields, **overrides})


def run_all(engine, requests) -> dict:
    """Add ``requests`` together, step until done, return the final outputs by request id."""
    for request in requests:
        engine.add_request(request)
    outputs = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            outputs[output.request_id] = output
    return outputs


def step_until_output(engine, max_steps: int = 1000) -> list:
    """Step the engine until a step returns outputs (a request runs one denoising step per
    engine step); returns them."""
    for _ in range(max_steps):
        outputs = engine.step()
        if outputs:
            return outputs
    raise AssertionError(f"no output after {max_steps} steps")


def png_of(output) -> bytes:
    assert output.finish_reason == "stop", output.error
    return output.media[0].png
