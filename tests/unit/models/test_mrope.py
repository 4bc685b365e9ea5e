"""Multimodal rotary positions (Qwen2.5-Omni's TMRoPE): the shared decoder with positions
``[3, T]`` equals transformers' decoders given the same 3-D position ids."""

import pytest
import torch

from omnistage.memory import Arena
from omnistage.models import registry
from omnistage.models.ar_config import ARModelConfig
from omnistage.models.loader import load_module
from tests.qwen2_5_omni_reference import load_model


@pytest.fixture(scope="module")
def folder(tiny_qwen2_5_omni_folder):
    return tiny_qwen2_5_omni_folder


def ours(folder, part):
    config = ARModelConfig.from_pretrained(folder, model_stage=part)
    family = registry.family(config.family)
    model = family.build_decoder(config, torch.float32)
    Arena("cpu").adopt(model)
    load_module(model, folder, rename=family.rename(part))
    return model


def vision_like_positions(length: int) -> torch.Tensor:
    """Text, then a 2 x 3 x 4 grid (time steps 25 apart), then text: rows that differ."""
    t, h, w = torch.meshgrid(torch.arange(2) * 25, torch.arange(3), torch.arange(4), indexing="ij")
    grid = torch.stack([t.flatten(), h.flatten(), w.flatten()]) + 5
    before = torch.arange(5).expand(3, -1)
    after_start = int(grid.max()) + 1
    after = torch.arange(after_start, after_start + length - 5 - grid.shape[1]).expand(3, -1)
    return torch.cat([before, grid, after], dim=1)


def test_config_reads_the_sections(folder):
    config = ARModelConfig.from_pretrained(folder, model_stage="thinker")
    assert config.rope.mrope_section == (2, 3, 3)
    assert sum(config.rope.mrope_section) == config.head_dim // 2


@pytest.mark.parametrize("part", ["thinker", "talker"])
def test_three_row_positions_match_transformers(folder, part):
    hf = load_model(str(folder))
    decoder = hf.thinker.model.language_model if part == "thinker" else hf.talker.model
    model = ours(folder, part)
    positions = vision_like_positions(40)
    width = model.config.embedding_size or model.config.hidden_size
    embeds = torch.randn(40, width, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        if part == "talker":  # transformers' talker projects the thinker's width itself
            hidden_in = hf.talker.thinker_to_talker_proj(embeds)[None]
        else:
            hidden_in = embeds[None]
        expected = decoder(
            inputs_embeds=hidden_in, position_ids=positions[:, None, :]
        ).last_hidden_state[0]
        got = model(None, positions, inputs_embeds=embeds)
    assert (got - expected).abs().max().item() <= 1e-5


def test_equal_rows_are_the_ordinary_rotary(folder):
    model = ours(folder, "thinker")
    ids = torch.arange(3, 23)
    with torch.no_grad():
        plain = model(ids, torch.arange(20))
        three = model(ids, torch.arange(20).expand(3, -1))
    assert torch.equal(plain, three)
