"""CUDA-only: the thinker's audio and vision encoders run on the device (their derived buffers
follow the weights there) and give the CPU's embeddings within float noise."""

import pytest
import torch

from omnistage.models.qwen2_5_omni import FAMILY
from omnistage.models.qwen2_5_omni.tiny import DEFAULT, build_tiny_qwen2_5_omni
from tests.unit.models.qwen2_5_omni.test_encoders import mixed, thinker

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_qwen2_5_omni(tmp_path_factory.mktemp("omni-encoders-gpu"), DEFAULT)


@pytest.mark.parametrize("use_audio_in_video", [False, True])
def test_encoders_on_the_device_equal_the_cpus(folder, use_audio_in_video):
    cpu, gpu = thinker(folder), thinker(folder, device="cuda")
    out = mixed(FAMILY.prompt_processor(folder), use_audio_in_video)
    for item in out.items:
        expected = cpu.encoders[item.modality](**item.data)
        data = {k: v.to("cuda") for k, v in item.data.items()}
        got = gpu.encoders[item.modality](**data).cpu()
        assert got.shape == expected.shape
        assert (got - expected).abs().max().item() <= 1e-3 * max(1.0, expected.abs().max().item())
