"""The diffusion family adapter: the registry finds a folder's family by ``_class_name``, and
the PixArt adapter's pieces run on their own, with plain objects for requests."""

import json
import shutil
from dataclasses import dataclass, field

import diffusers
import pytest
import torch

from omnistage.memory import Arena
from omnistage.models import registry
from omnistage.models.diffusion.family import NoiseQuery
from omnistage.models.loader import CheckpointError
from omnistage.models.tiny_diffusion import IMAGE


@dataclass(frozen=True)
class Params:
    num_inference_steps: int = 2
    height: int | None = None
    width: int | None = None
    guidance_scale: float = 3.0
    negative_prompt: str = ""
    max_sequence_length: int | None = None

    @property
    def uses_guidance(self) -> bool:
        return self.guidance_scale > 1.0


@dataclass
class Request:
    prompt: str | None = None
    prompt_embeds: torch.Tensor | None = None
    negative_prompt_embeds: torch.Tensor | None = None
    params: Params = field(default_factory=Params)


@pytest.fixture(scope="module")
def one_torch_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    from omnistage.models.tiny import build_preset

    return build_preset("image", tmp_path_factory.mktemp("image"))


@pytest.fixture(scope="module")
def family_and_pipeline(image_folder, one_torch_thread):
    family = registry.family_of_folder(image_folder)
    return family, family.build(image_folder, Arena("cpu"))


def test_an_unknown_pipeline_class_is_refused_naming_the_supported_ones(tmp_path):
    index = {"_class_name": "NoSuchPipeline", "transformer": ["diffusers", "X"]}
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError) as info:
        registry.family_of_folder(tmp_path)
    message = str(info.value)
    assert "NoSuchPipeline" in message
    assert "PixArtAlphaPipeline" in message and "PixArtSigmaPipeline" in message


def test_the_tiny_presets_are_found_as_pixart(image_folder):
    assert registry.family_of_folder(image_folder).name == "pixart"


def test_the_pixart_adapter_pieces_run_alone(family_and_pipeline):
    family, pipeline = family_and_pipeline
    limits = family.limits(pipeline)
    assert (limits.size_multiple, limits.embedding_dim, limits.native_size) == (8, 256, 64)
    assert limits.has_text_encoder and limits.max_inference_steps == 1000

    request = Request(prompt="a red cat")
    conditioning = family.encode(pipeline, request)
    assert conditioning.cond.embeds.shape == (IMAGE.max_sequence_length, 256)
    assert conditioning.uncond.embeds.shape == conditioning.cond.embeds.shape
    assert family.batch_key(pipeline, request) == (64, 64, 2, True)

    scheduler = getattr(diffusers, pipeline.scheduler_class_name).from_config(
        pipeline.scheduler_config
    )
    family.set_timesteps(pipeline, scheduler, request)
    assert len(scheduler.timesteps) == 2
    latents = family.prepare_latents(pipeline, request, 7, scheduler)
    drawn = torch.randn((1, 4, 16, 16), generator=torch.Generator("cpu").manual_seed(7))
    assert torch.equal(latents, drawn * getattr(scheduler, "init_noise_sigma", 1.0))

    with torch.inference_mode():
        query = NoiseQuery(latents, scheduler.timesteps[0], [conditioning], [3.0])
        noise = family.predict_noise(pipeline, query)
        assert noise.shape == latents.shape and bool(torch.isfinite(noise).all())
        pixels = family.decode(pipeline, latents)
    assert pixels.shape == (64, 64, 3) and pixels.device.type == "cpu"
    assert float(pixels.min()) >= 0.0 and float(pixels.max()) <= 1.0


def test_unguided_requests_have_no_unconditional_input(family_and_pipeline):
    family, pipeline = family_and_pipeline
    embeds = torch.randn(5, 256, generator=torch.Generator().manual_seed(0))
    request = Request(prompt_embeds=embeds, params=Params(guidance_scale=1.0))
    conditioning = family.encode(pipeline, request)
    assert conditioning.uncond is None
    assert torch.equal(conditioning.cond.embeds, embeds)
    assert conditioning.cond.mask.tolist() == [1] * 5


def test_pixart_refuses_a_dynamic_shift_scheduler(image_folder, tmp_path):
    folder = tmp_path / "dynamic-shift"
    shutil.copytree(image_folder, folder)
    config_path = folder / "scheduler" / "scheduler_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "use_dynamic_shifting": True}))
    arena = Arena("cpu")
    try:
        with pytest.raises(CheckpointError, match="use_dynamic_shifting"):
            registry.family_of_folder(folder).build(folder, arena)
    finally:
        arena.close()
