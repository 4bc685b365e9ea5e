import hashlib
import json
from pathlib import Path

import pytest

from omnistage.models.tiny import build_preset


def digests(folder: Path) -> dict[str, str]:
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.rglob("*"))
        if f.is_file()
    }


@pytest.mark.parametrize("preset", ["image", "image-cond"])
def test_same_preset_gives_identical_bytes(preset, tmp_path):
    first = digests(build_preset(preset, tmp_path / "a"))
    second = digests(build_preset(preset, tmp_path / "b"))
    assert first == second
    assert "transformer/diffusion_pytorch_model.safetensors" in first


def test_presets_are_diffusers_folders_with_the_documented_components(tmp_path):
    image = json.loads((build_preset("image", tmp_path / "image") / "model_index.json").read_text())
    cond_folder = build_preset("image-cond", tmp_path / "cond")
    cond = json.loads((cond_folder / "model_index.json").read_text())
    assert image["text_encoder"] == ["transformers", "T5EncoderModel"]
    assert image["scheduler"] == ["diffusers", "FlowMatchEulerDiscreteScheduler"]
    assert cond["text_encoder"] == [None, None] and cond["tokenizer"] == [None, None]
    transformer = json.loads((cond_folder / "transformer" / "config.json").read_text())
    assert transformer["caption_channels"] == 256  # the demo thinker's hidden size


def test_diffusers_itself_loads_a_preset(tmp_path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(build_preset("image", tmp_path / "image"))
    assert type(pipe).__name__ == "PixArtSigmaPipeline"
    assert pipe.text_encoder is not None and pipe.tokenizer("a cat").input_ids[-1] == 1  # </s>
