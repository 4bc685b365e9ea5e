"""The Qwen3-Omni thinker on the tiny checkpoint: its config and renames, its encoders (loaded
through omnistage's loader into an arena) against transformers' ``get_audio_features`` /
``get_image_features`` (DeepStack features included), and the whole thinker — our decoder,
encoders and prompt processor — against transformers' ``thinker.generate`` on transformers'
processor output: the same prompt, the same first logits, the same greedy ids, for a text, an
audio, an image and a mixed prompt; and the same logits on two tensor-parallel ranks."""

from __future__ import annotations

import pytest
import torch

from omnistage.errors import CheckpointError, InvalidRequestError
from omnistage.models.loader import checkpoint_files, open_files
from omnistage.models.qwen3_omni.config import OmniTokens, read_config, thinker_config
from omnistage.models.qwen3_omni.inputs import Qwen3OmniPromptProcessor
from omnistage.models.qwen3_omni.weights import decoder_rename
from omnistage.models.tensor_parallel import shards_of
from omnistage.models.tokenizer import Tokenizer
from tests.unit.models.qwen3_omni.thinker_helpers import (
    CASES,
    greedy,
    hf_inputs,
    hf_processor,
    hf_thinker,
    media_of,
    messages_of,
    our_thinker,
    prompt_inputs,
    prompt_logits,
    tiny_folder,
    tp2_logits,
)

STEPS = 6


@pytest.fixture(scope="module")
def folder():
    return tiny_folder()


@pytest.fixture(scope="module")
def ours(folder):
    return our_thinker(folder)


@pytest.fixture(scope="module")
def hf(folder):
    return hf_thinker(folder)


@pytest.fixture(scope="module")
def processor(folder):
    return Qwen3OmniPromptProcessor(folder)


@pytest.fixture(scope="module")
def hf_proc(folder):
    return hf_processor(folder)


def test_the_thinker_config_is_the_text_decoders(folder, hf):
    raw = read_config(folder)
    config = thinker_config(raw)
    text = hf.config.text_config
    assert (config.family, config.part) == ("qwen3_omni", "thinker")
    assert (config.hidden_size, config.head_dim, config.num_hidden_layers) == (
        text.hidden_size,
        text.head_dim,
        text.num_hidden_layers,
    )
    assert config.qk_norm and not config.qkv_bias
    assert (config.num_experts, config.num_experts_per_tok) == (
        text.num_experts,
        text.num_experts_per_tok,
    )
    assert config.norm_topk_prob == text.norm_topk_prob
    assert config.rope.mrope_interleaved
    assert list(config.rope.mrope_section) == text.rope_parameters["mrope_section"]
    assert sorted(config.extras) == ["audio_config", "vision_config"]
    tokens = OmniTokens.from_config(raw)
    assert (tokens.audio, tokens.image, tokens.video) == (
        hf.config.audio_token_id,
        hf.config.image_token_id,
        hf.config.video_token_id,
    )
    assert tokens.position_id_per_seconds == hf.config.position_id_per_seconds
    assert tokens.im_start == raw["im_start_token_id"] and tokens.user == raw["user_token_id"]
    broken = {**raw, "thinker_config": {**raw["thinker_config"], "text_config": {}}}
    with pytest.raises(CheckpointError, match="text_config"):
        thinker_config(broken)


def test_the_rename_reads_every_thinker_tensor(folder, ours):
    rename = decoder_rename("thinker")
    with open_files(checkpoint_files(folder)) as files:
        keys = [k for f in files for k in f.keys()]  # noqa: SIM118
    names = {rename(k) for k in keys if k.startswith("thinker.")}
    assert None not in names
    assert names == set(ours.state_dict())  # the load was strict: nothing else is missing
    assert not any(rename(k) for k in keys if not k.startswith("thinker."))
    assert rename("thinker.visual.merger_list.0.ln_q.weight") == (
        "encoders.image.visual.merger_list.0.ln_q.weight"
    )
    assert rename("thinker.model.layers.0.mlp.experts.3.up_proj.weight") == (
        "model.layers.0.mlp.experts.3.up_proj.weight"
    )
    assert not any(n.startswith("encoders") for n in shards_of(ours))  # whole on every rank
    with pytest.raises(CheckpointError, match="decoder parts"):
        decoder_rename("vocoder")


@torch.no_grad()
def test_each_item_encodes_as_transformers_features(folder, ours, hf, processor):
    ids = Tokenizer.from_pretrained(folder).encode_chat(messages_of("mixed"))
    out = processor.process(ids, media_of("mixed"), {})
    for item in out.items:
        got = ours.encoders[item.modality](**item.data)
        if item.modality == "audio":
            features = item.data["input_features"]
            mask = torch.ones(1, features.shape[1], dtype=torch.long)
            ref = hf.model.get_audio_features(features[None], mask).last_hidden_state
            assert got.shape == (item.length, 64) and torch.equal(got, ref)
            continue
        ref = hf.model.get_image_features(item.data["pixel_values"], item.data["image_grid_thw"])
        deepstack = [feature[0] for feature in ref.deepstack_features]
        assert got.shape == (1 + len(deepstack), item.length, 64)
        assert torch.equal(got, torch.stack([ref.pooler_output[0], *deepstack]))


@pytest.mark.parametrize("case", sorted(CASES))
@torch.no_grad()
def test_greedy_ids_equal_transformers_generate(case, folder, ours, hf, hf_proc, processor):
    ref = hf_inputs(hf_proc, case)
    ids = Tokenizer.from_pretrained(folder).encode_chat(messages_of(case))
    prompt = processor.process(ids, media_of(case), {})
    assert prompt.token_ids == ref["input_ids"][0].tolist()
    hf.model.rope_deltas = None
    out = hf.generate(
        **ref,
        max_new_tokens=STEPS,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
    )
    theirs = out.sequences[0, len(prompt.token_ids) :].tolist()
    mine, logits = greedy(ours, prompt, STEPS)
    torch.testing.assert_close(logits, out.logits[0][0], rtol=0, atol=1e-5)
    assert mine == theirs
    if case == "image":  # the DeepStack rows matter: without them the logits differ
        embeds, rows = prompt_inputs(ours, prompt)
        plain = ours.compute_logits(ours(None, prompt.positions, inputs_embeds=embeds))[-1]
        assert rows is not None and not torch.allclose(plain, logits, atol=1e-3)


def test_bad_image_data_is_refused(ours):
    with pytest.raises(InvalidRequestError) as err:
        ours.encoders["image"](torch.zeros(5, 1536), torch.tensor([[1, 2, 2]]))
    assert err.value.field == "multi_modal.data.pixel_values"
    with pytest.raises(InvalidRequestError) as err:
        ours.encoders["audio"](torch.zeros(80, 10))
    assert err.value.field == "multi_modal.data.input_features"


def test_two_tensor_parallel_ranks_compute_one_ranks_logits(folder, ours, processor):
    """Attention split by heads, every expert over its features, the encoders whole on each
    rank and the DeepStack rows added on each: two gloo ranks (spawned) loading their slices
    compute the logits of one, for an image and an audio prompt."""
    tokenizer = Tokenizer.from_pretrained(folder)
    prompts = [
        processor.process(tokenizer.encode_chat(messages_of(case)), media_of(case), {})
        for case in ("image", "audio")
    ]
    for theirs, mine in zip(tp2_logits(folder, prompts), prompt_logits(ours, prompts), strict=True):
        torch.testing.assert_close(theirs, mine, rtol=0, atol=1e-5)
