import json
from pathlib import Path

import pytest
import torch

from omnistage.config import StageConfig


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """Tiny models gain nothing from a second thread (and a busy 2-core machine punishes it)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def omni_folder(tmp_path_factory) -> Path:
    """A tiny Qwen2.5-Omni checkpoint (thinker, talker, token2wav, two voices), sharded."""
    from omnistage.models.qwen2_5_omni.tiny import build_tiny_qwen2_5_omni

    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("omni"))


@pytest.fixture(scope="session")
def reference_model(omni_folder):
    """transformers' own ``Qwen2_5OmniToken2WavModel``, filled by the safetensors library
    (not omnistage's loader) from the checkpoint's ``token2wav.*`` tensors."""
    from safetensors.torch import load_file
    from transformers import Qwen2_5OmniToken2WavConfig
    from transformers.models.qwen2_5_omni.modeling_qwen2_5_omni import (
        Qwen2_5OmniToken2WavModel,
    )

    raw = json.loads((omni_folder / "config.json").read_text())
    config = Qwen2_5OmniToken2WavConfig.from_dict(raw["token2wav_config"])
    model = Qwen2_5OmniToken2WavModel._from_config(config).eval()
    state = {}
    for file in sorted(omni_folder.glob("*.safetensors")):
        for name, tensor in load_file(file).items():
            if name.startswith("token2wav."):
                state[name.removeprefix("token2wav.")] = tensor
    model.load_state_dict(state, strict=True)
    return model


def reference_waveform(model, folder: Path, codes, voice: str, seed: int, **kwargs):
    """What transformers' ``generate`` does for one sample: the voice's tensors, then
    ``token2wav`` after ``torch.manual_seed(seed)``."""
    speakers = torch.load(folder / "spk_dict.pt", weights_only=True)
    cond = speakers[voice]["cond"].float().expand(1, -1)
    ref_mel = speakers[voice]["ref_mel"].float().expand(1, -1, -1)
    with torch.random.fork_rng(devices=[]), torch.no_grad():
        torch.manual_seed(seed)
        wav = model(torch.tensor([codes]), conditioning=cond, reference_mel=ref_mel, **kwargs)
    return wav.reshape(-1).float()


def code2wav_config(folder: Path, **overrides) -> StageConfig:
    fields = {
        "stage_id": 2,
        "kind": "code2wav",
        "model": str(folder),
        "model_stage": "code2wav",
        "enable_sleep_mode": True,
    }
    return StageConfig(**{**fields, **overrides})


def codes_of(length: int, seed: int = 0, codebook: int = 100) -> list[int]:
    return torch.randint(
        0, codebook, (length,), generator=torch.Generator().manual_seed(seed)
    ).tolist()


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
    for _ in range(max_steps):
        outputs = engine.step()
        if outputs:
            return outputs
    raise AssertionError(f"no output after {max_steps} steps")


def samples_of(output) -> torch.Tensor:
    assert output.finish_reason == "stop", output.error
    return output.media[0].samples
