"""The Wan family's checks of a folder (Wan 2.2's layouts and other schedulers are refused,
naming what) and the half-precision build keeping in float32 what diffusers keeps so."""

import json
import shutil

import pytest
import torch

from omnistage.memory import Arena
from omnistage.models import registry
from omnistage.models.diffusion.components import build_empty_module, read_model_index
from omnistage.models.loader import CheckpointError
from tests.unit.stage.diffusion.family_cases import preset_folder


@pytest.fixture(scope="module")
def wan_folder():
    return preset_folder("tiny-wan")


@pytest.mark.parametrize(
    ("index_fields", "named"),
    [
        ({"boundary_ratio": 0.875}, "boundary_ratio"),
        ({"expand_timesteps": True}, "expand_timesteps"),
        ({"scheduler": ["diffusers", "DDIMScheduler"]}, "UniPCMultistepScheduler"),
    ],
)
def test_folders_it_cannot_serve_are_refused_naming_why(wan_folder, tmp_path, index_fields, named):
    folder = tmp_path / "wan"
    shutil.copytree(wan_folder, folder)
    index = json.loads((folder / "model_index.json").read_text())
    (folder / "model_index.json").write_text(json.dumps({**index, **index_fields}))
    arena = Arena("cpu")
    try:
        with pytest.raises(CheckpointError, match=named):
            registry.family_of_folder(folder).build(folder, arena, load=False)
    finally:
        arena.close()


def test_half_precision_keeps_in_float32_what_diffusers_keeps(wan_folder):
    specs = read_model_index(wan_folder)
    transformer = build_empty_module(wan_folder, specs["transformer"], torch.bfloat16)
    kept = transformer._keep_in_fp32_modules
    for name, param in transformer.named_parameters():
        expected = torch.float32 if set(name.split(".")) & set(kept) else torch.bfloat16
        assert param.dtype == expected, name
    # transformers keeps T5's `wo` in float32 for float16 only
    encoder = build_empty_module(wan_folder, specs["text_encoder"], torch.float16)
    assert {p.dtype for n, p in encoder.named_parameters() if ".wo." in n} == {torch.float32}
    encoder = build_empty_module(wan_folder, specs["text_encoder"], torch.bfloat16)
    assert {p.dtype for p in encoder.parameters()} == {torch.bfloat16}
