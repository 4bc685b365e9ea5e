"""The tiny Qwen3-Omni builder, and transformers' generation through tests/qwen3_omni_reference.py
(whose pieces are checked here, position by position, against the data flow its docstring
describes)."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from omnistage.models.qwen3_omni.tiny import (
    DEFAULT,
    ROLES,
    SPECIAL_TOKENS,
    build_tiny_qwen3_omni,
    hf_config,
    randomise,
    token_ids,
)
from omnistage.models.qwen3_omni.tiny_specs import SUPPRESSED_BLOCK
from tests.qwen3_omni_media import hf_processor, processor_outputs
from tests.qwen3_omni_reference import load_model, prompt_ids, reference_generate

PROMPT = "Hello! How are you today?"
close = dict(rtol=1e-5, atol=1e-6)


def digests(folder: Path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.iterdir())
        if not f.name.startswith(".")
    }


def tensor(folder: Path, name: str) -> torch.Tensor:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    with safe_open(str(folder / index["weight_map"][name]), "pt") as f:
        return f.get_tensor(name)


@pytest.fixture(scope="module")
def folder(tiny_qwen3_omni_folder):
    return Path(tiny_qwen3_omni_folder).resolve()


@pytest.fixture(scope="module")
def model(folder):
    return load_model(str(folder))


@pytest.fixture(scope="module")
def text_ref(folder):
    return reference_generate(
        folder, PROMPT, voice="Ethan", thinker_max_new_tokens=8, talker_max_new_tokens=10
    )


def test_same_spec_and_seed_give_identical_bytes(folder, tmp_path):
    again = build_tiny_qwen3_omni(tmp_path / "again", DEFAULT)
    assert digests(again) == digests(folder)
    other = build_tiny_qwen3_omni(tmp_path / "seed1", DEFAULT, seed=1)
    name = "talker.codec_head.weight"
    assert not torch.equal(tensor(other, name), tensor(again, name))


def test_transformers_loads_exactly_the_seeded_weights(folder, model):
    from tokenizers import Tokenizer
    from transformers import Qwen3OmniMoeForConditionalGeneration

    ids = token_ids(Tokenizer.from_file(str(folder / "tokenizer.json")))
    fresh = Qwen3OmniMoeForConditionalGeneration(hf_config(DEFAULT, ids))
    randomise(fresh, 0)
    loaded, built = model.state_dict(), fresh.state_dict()
    assert loaded.keys() == built.keys()
    assert all(torch.equal(loaded[k], built[k]) for k in built)
    names = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    tops = {".".join(k.split(".")[:2]) for k in names}
    assert tops == {
        "thinker.model", "thinker.lm_head", "thinker.audio_tower", "thinker.visual",
        "talker.model", "talker.codec_head", "talker.text_projection",
        "talker.hidden_projection", "talker.code_predictor", "code2wav.code_embedding",
        "code2wav.pre_transformer", "code2wav.upsample", "code2wav.decoder",
    }  # fmt: skip
    assert "thinker.model.layers.0.mlp.experts.3.down_proj.weight" in names  # real layout
    assert "talker.model.layers.0.mlp.shared_expert_gate.weight" in names


def test_token_ids_configs_and_processor_fit_together(folder, model):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    cfg, talker = model.config, model.config.talker_config
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    ids = token_ids(tokenizer)
    assert all(len(tokenizer.encode(role).ids) == 1 for role in ROLES)
    assert (cfg.user_token_id, cfg.assistant_token_id, cfg.system_token_id) == (
        ids["user"], ids["assistant"], ids["system"]
    )  # fmt: skip
    assert (cfg.tts_pad_token_id, cfg.tts_bos_token_id, cfg.tts_eos_token_id) == (
        ids["<tts_pad>"], ids["<tts_text_bos>"], ids["<tts_text_eod>"]
    )  # fmt: skip
    thinker = cfg.thinker_config
    assert thinker.audio_token_id == talker.audio_token_id == ids["<|audio_pad|>"]
    assert thinker.image_token_id == talker.image_token_id == ids["<|image_pad|>"]
    assert thinker.vision_start_token_id == talker.vision_start_token_id == 3
    # every code sampleable, every special in the block generate suppresses
    vocab, codebook = talker.text_config.vocab_size, model.config.code2wav_config.codebook_size
    assert vocab - SUPPRESSED_BLOCK == codebook == talker.code_predictor_config.vocab_size
    specials = [talker.codec_pad_id, talker.codec_bos_id, talker.codec_eos_token_id]
    specials += [talker.codec_nothink_id, *talker.speaker_id.values()]
    assert all(codebook <= s < vocab for s in specials)
    assert sorted(talker.speaker_id) == ["aiden", "chelsie", "ethan"]
    assert talker.num_code_groups == model.config.code2wav_config.num_quantizers == 4
    assert 0 < talker.accept_hidden_layer < thinker.text_config.num_hidden_layers
    assert len(thinker.vision_config.deepstack_visual_indexes) < talker.accept_hidden_layer
    processor = hf_processor(str(folder))
    assert processor.tokenizer.image_token_id == thinker.image_token_id
    assert processor.tokenizer.audio_token_id == thinker.audio_token_id
    assert processor.image_processor.patch_size == thinker.vision_config.patch_size
    text = prompt_ids(folder, PROMPT)
    assert text[:2] == [cfg.im_start_token_id, cfg.user_token_id]
    assert text[-3:] == [
        cfg.im_start_token_id,
        cfg.assistant_token_id,
        tokenizer.encode("\n").ids[0],
    ]


def _check_text_flow(ref, model, voice):
    """The docstring of tests/qwen3_omni_reference.py, position by position."""
    cfg, tc = model.config, model.config.talker_config
    talker, predictor = model.talker, model.talker.code_predictor
    embed = model.thinker.get_input_embeddings().weight
    proj = talker.text_projection
    codec = talker.get_input_embeddings().weight
    groups = tc.num_code_groups
    L, T = len(ref.prompt_ids), len(ref.thinker_ids)
    fed = ref.prompt_ids + ref.thinker_ids[:-1]
    # thinker: embeddings, greedy argmax over the post-norm rows, text positions
    assert torch.equal(ref.thinker_embeds, embed[fed])
    logits = model.thinker.lm_head(ref.thinker_last_hidden[L - 1 :])
    assert logits.argmax(-1).tolist() == ref.thinker_ids
    positions = torch.cat(ref.thinker_position_ids, dim=-1)
    assert torch.equal(positions, torch.arange(L + T - 1).expand(3, -1).to(positions.dtype))
    # talker prefill: the user turn, then 9 assistant rows
    U = L - 3
    assert ref.talker_input_ids == ref.prompt_ids[:U] + [cfg.tts_pad_token_id] * 9
    bos, eos, pad = proj(embed[[cfg.tts_bos_token_id, cfg.tts_eos_token_id, cfg.tts_pad_token_id]])
    torch.testing.assert_close(ref.tts_pad_embed, pad, rtol=0, atol=0)
    expected = torch.cat([proj(embed[ref.prompt_ids]), pad.expand(4, -1), bos[None]])
    expected = torch.cat([expected, proj(embed[ref.thinker_ids[:1]])])
    specials = [tc.codec_nothink_id, tc.codec_think_bos_id, tc.codec_think_eos_id]
    specials += [tc.speaker_id[voice.lower()], tc.codec_pad_id, tc.codec_bos_id]
    expected[U + 3 :] += codec[specials]
    torch.testing.assert_close(ref.talker_inputs_embeds, expected, **close)
    trailing = torch.cat([proj(embed[ref.thinker_ids[1:-1]]), eos[None]])
    torch.testing.assert_close(ref.trailing_text_hidden, trailing, **close)
    # talker steps: logits from the post-norm row the code predictor gets, greedy choices
    seq, frames = ref.talker_sequence, ref.talker_codes.shape[1]
    assert len(ref.talker_logits) == len(ref.talker_hidden) == len(seq)
    vocab = codec.shape[0]
    for k, raw in enumerate(ref.talker_logits):
        torch.testing.assert_close(talker.codec_head(ref.talker_hidden[k]), raw, rtol=0, atol=0)
        seen = torch.tensor(sorted(set(seq[:k])), dtype=torch.long)
        chosen = raw.clone()
        chosen[seen] = torch.where(raw[seen] < 0, raw[seen] * 1.05, raw[seen] / 1.05)
        chosen[[i for i in range(vocab - 1024, vocab) if i != tc.codec_eos_token_id]] = -torch.inf
        assert chosen.argmax().item() == seq[k]
    assert frames == (
        seq.index(tc.codec_eos_token_id) if tc.codec_eos_token_id in seq else len(seq) - 1
    )
    assert ref.talker_codes[0].tolist() == seq[:frames]
    # code predictor per frame: [talker hidden, codec_embed(code0)] in, greedy residual codes out
    assert len(ref.predictor_inputs) == frames
    for f in range(frames):
        code0, residual = seq[f], ref.predictor_codes[f]
        inputs = torch.stack([ref.talker_hidden[f], codec[code0]])
        torch.testing.assert_close(ref.predictor_inputs[f], inputs, rtol=0, atol=0)
        assert ref.predictor_logits[f].argmax(-1).tolist() == residual
        assert ref.talker_codes[1:, f].tolist() == residual
        tables = [predictor.model.codec_embedding[i].weight for i in range(groups - 1)]
        rows = torch.stack([tables[i][residual[i]] for i in range(groups - 1)])
        torch.testing.assert_close(ref.predictor_step_embeds[f], rows[:-1], rtol=0, atol=0)
        text = ref.trailing_text_hidden[f] if f < T - 1 else ref.tts_pad_embed
        step = codec[code0] + rows.sum(0) + text
        torch.testing.assert_close(ref.talker_step_embeds[f], step, **close)
    positions = torch.cat(ref.talker_position_ids, dim=-1).long()
    assert torch.equal(positions, torch.arange(U + 9 + len(seq) - 1).expand(3, -1))
    # code2wav: the whole frames, decoded in one chunk
    assert torch.equal(ref.code2wav_codes[0], ref.talker_codes)
    wav = model.code2wav.chunked_decode(
        ref.talker_codes[None], chunk_size=300, left_context_size=25
    )
    np.testing.assert_array_equal(wav.reshape(-1).numpy(), ref.waveform)
    length = frames
    for rate in model.config.code2wav_config.upsampling_ratios:
        length *= rate
    for rate in model.config.code2wav_config.upsample_rates:
        length = (length - 1) * rate  # a causal transposed conv trims one input frame
    assert ref.waveform.shape == (length,) and ref.waveform.dtype == np.float32


@torch.no_grad()
def test_reference_text_prompt_is_the_documented_data_flow(text_ref, model):
    assert len(text_ref.thinker_ids) == 8 and len(set(text_ref.thinker_ids)) >= 4
    assert text_ref.talker_codes.shape == (4, 9)  # 10 sampled, the last without residuals
    assert len(set(text_ref.talker_codes[0].tolist())) >= 4  # the random talker varies
    assert np.isfinite(text_ref.waveform).all() and 0.05 < text_ref.waveform.std() < 0.9
    _check_text_flow(text_ref, model, "Ethan")


@torch.no_grad()
def test_reference_image_prompt_projects_the_accepted_layer_at_the_image(folder, model):
    outputs = processor_outputs(str(folder), "image")
    ref = reference_generate(
        folder, None, voice="Chelsie", thinker_max_new_tokens=4, talker_max_new_tokens=4,
        processor_outputs=outputs,
    )  # fmt: skip
    cfg = model.config
    ids = ref.prompt_ids
    image = [i for i, t in enumerate(ids) if t == cfg.thinker_config.image_token_id]
    assert len(image) == outputs["image_grid_thw"].prod() // 4 == 40
    U = len(ids) - 3
    rows = ref.talker_inputs_embeds[:U]
    hidden = model.talker.hidden_projection(ref.thinker_accept_hidden[image])
    torch.testing.assert_close(rows[image], hidden, **close)
    assert not torch.allclose(ref.thinker_accept_hidden, ref.thinker_last_hidden)
    # the talker positions its own ids: 3-D rows over the 5 x 8 merged patches
    positions = ref.talker_position_ids[0][:, image].long()
    assert positions[1].unique().numel() == 5 and positions[2].unique().numel() == 8
    prompt = len(ids)  # the user turn and <|im_start|>assistant\n: placed alike by both
    assert torch.equal(ref.talker_position_ids[0][:, :prompt], ref.thinker_position_ids[0])


def test_audio_and_image_need_the_restored_audio_window(folder):
    outputs = processor_outputs(str(folder), "audio_image")
    common = dict(voice="Aiden", thinker_max_new_tokens=3, talker_max_new_tokens=3)
    with pytest.raises(AttributeError, match="audio_config"):
        reference_generate(
            folder, None, processor_outputs=outputs, restore_talker_audio_n_window=False, **common
        )
    ref = reference_generate(folder, None, processor_outputs=outputs, **common)
    assert ref.talker_codes.shape == (4, 2)
    assert "audio_feature_lengths" in ref.talker_generate_kwargs


def test_build_is_the_preset_builder(folder):
    from omnistage.models import tiny

    assert tiny.PRESETS["tiny-qwen3-omni"] == "omnistage.models.qwen3_omni.tiny:build"
    assert tiny.is_built(folder, "tiny-qwen3-omni")
    assert json.loads((folder / "config.json").read_text())["model_type"] == "qwen3_omni_moe"
