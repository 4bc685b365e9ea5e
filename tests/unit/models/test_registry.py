"""The model registry: a checkpoint's family from what it says it is, one line per family,
and what a family says (its decoder config, its pipeline); an unknown model refused naming
the supported ones."""

from __future__ import annotations

import json

import pytest

from omnistage.config import ConfigError
from omnistage.errors import CheckpointError
from omnistage.models import registry
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.tiny import ensure_preset
from omnistage.pipelines import cache_dir, pipeline_from_model
from tests.unit.models.hf_checkpoints import build_checkpoint


def test_every_family_is_one_entry_with_a_home_that_exposes_it():
    names = [f.name for f in registry.FAMILIES]
    assert len(names) == len(set(names))
    said = [a for f in registry.FAMILIES for a in (*f.architectures, *f.pipeline_classes)]
    assert len(said) == len(set(said))  # no checkpoint can mean two families
    for entry in registry.FAMILIES:
        assert registry.family(entry.name).name == entry.name
        assert registry.is_family_module(entry.home)


@pytest.mark.parametrize(
    ("raw", "family"),
    [
        ({"architectures": ["Qwen2ForCausalLM"]}, "qwen2"),
        ({"architectures": ["Unknown", "LlamaForCausalLM"]}, "llama"),
        ({"model_type": "qwen3"}, "qwen3"),
        ({"architectures": ["Qwen3MoeForCausalLM"]}, "qwen3_moe"),
        ({"model_type": "qwen2_5_omni"}, "qwen2_5_omni"),
        ({"_class_name": "PixArtSigmaPipeline"}, "pixart"),
    ],
)
def test_a_checkpoint_finds_its_family(raw, family):
    found = registry.find(raw)
    assert found is not None and found.name == family


def test_an_unknown_model_is_refused_naming_the_supported_ones():
    with pytest.raises(CheckpointError) as info:
        registry.family_of({"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(name in message for name in ("Qwen2ForCausalLM", "LlamaForCausalLM", "qwen3"))


def test_an_unknown_processor_is_refused_naming_the_known_ones():
    with pytest.raises(ValueError, match="thinker_to_talker"):
        registry.processor("sharpen")


def test_the_experts_of_a_moe_checkpoint_are_read_layer_by_layer(tmp_path):
    build_checkpoint("qwen3-moe", tmp_path)
    config = ARModelConfig.from_pretrained(tmp_path)
    assert (config.family, config.num_experts, config.num_experts_per_tok) == ("qwen3_moe", 4, 2)
    assert [config.uses_experts(i) for i in range(2)] == [True, False]  # layer 1: mlp only


def test_a_decoder_folder_is_one_ar_stage_and_an_omni_folder_three(tmp_path):
    build_checkpoint("qwen3", tmp_path)
    (stage,) = pipeline_from_model(str(tmp_path)).stages
    assert (stage.kind, stage.model, stage.model_stage) == ("ar", str(tmp_path), None)
    omni = ensure_preset("tiny-qwen2.5-omni", cache_dir() / "tiny-qwen2.5-omni")
    stages = pipeline_from_model(str(omni), max_num_seqs=4).stages
    assert [(s.name, s.kind, s.model_stage, s.input_processor) for s in stages] == [
        ("thinker", "ar", "thinker", None),
        ("talker", "ar", "talker", "thinker_to_talker"),
        ("code2wav", "code2wav", "code2wav", "talker_to_code2wav"),
    ]
    assert all(getattr(s, s.kind).max_num_seqs == 4 and s.model == str(omni) for s in stages)


def test_a_diffusers_folder_is_one_diffusion_stage():
    folder = ensure_preset("image", cache_dir() / "image")
    (stage,) = pipeline_from_model(str(folder)).stages
    assert stage.kind == "diffusion"


def test_a_part_of_a_single_model_is_refused(tmp_path):
    build_checkpoint("qwen2-tied", tmp_path)
    with pytest.raises(CheckpointError, match="model_stage 'talker'"):
        ARModelConfig.from_pretrained(tmp_path, "talker")


def test_a_folder_that_names_no_model_is_a_config_error(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["T5Model"]}))
    with pytest.raises(ConfigError, match="T5Model"):
        pipeline_from_model(str(tmp_path))


def test_the_families_say_what_they_can_do_by_type():
    """Capabilities are protocols a family derives from (``omnistage.models.interfaces``),
    asked with their ``TypeIs`` helpers; the registry hands out typed families."""
    from omnistage.models.diffusion.family import is_diffusion_family
    from omnistage.models.interfaces import (
        is_ar_family,
        supports_multimodal,
        supports_processors,
        supports_vocoder,
    )
    from omnistage.models.omni_family import OmniFamily

    omni = [registry.family(n) for n in ("qwen2_5_omni", "qwen3_omni")]
    assert all(isinstance(f, OmniFamily) for f in omni)
    for f in omni:
        assert is_ar_family(f) and supports_multimodal(f) and supports_vocoder(f)
        assert supports_processors(f) and not is_diffusion_family(f)
    decoder = registry.ar_family("qwen2")
    assert not supports_multimodal(decoder) and not supports_vocoder(decoder)
    flux = registry.family("flux")
    assert is_diffusion_family(flux) and not is_ar_family(flux)
    with pytest.raises(CheckpointError, match="flux model is not served by an AR stage"):
        registry.ar_family("flux")


def test_a_familys_processors_are_its_own_under_its_name_and_the_old_names():
    for family, old in (("qwen2_5_omni", ""), ("qwen3_omni", "qwen3_")):
        for short in ("thinker_to_talker", "talker_to_code2wav"):
            declared = registry.processor(f"{family}.{short}")
            assert registry.processor(f"{old}{short}") is declared
    with pytest.raises(ValueError, match="qwen3_omni.thinker_to_talker"):
        registry.processor("qwen3_omni.sharpen")
