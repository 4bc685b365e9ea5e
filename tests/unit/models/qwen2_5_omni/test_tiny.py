"""The tiny Qwen2.5-Omni builder, and transformers' generation through tests/qwen2_5_omni_reference.py
(which also checks, position by position, the data flow its docstring describes)."""

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from omnistage.models.qwen2_5_omni.tiny import (
    ALT,
    DEFAULT,
    SPECIAL_TOKENS,
    TINY_QWEN_OMNI_SPECS,
    VOICES,
    build_tiny_qwen2_5_omni,
)
from tests.qwen2_5_omni_reference import load_model, prompt_ids, reference_generate

PROMPTS = ["Hello! How are you today?", "Tell me a story about a robot.", "Paris"]


def digests(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())}


def tensors(folder: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({key: f.get_tensor(key) for key in f.keys()})  # noqa: SIM118
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny-qwen-omni")
    return {
        name: build_tiny_qwen2_5_omni(root / name, spec)
        for name, spec in TINY_QWEN_OMNI_SPECS.items()
    }


def test_the_two_specs_differ_where_the_acceptance_tests_need_it():
    assert DEFAULT.num_layers != ALT.num_layers
    assert DEFAULT.hidden_size // DEFAULT.num_heads != ALT.hidden_size // ALT.num_heads
    assert DEFAULT.talker_head_dim != ALT.talker_head_dim
    assert DEFAULT.tie_word_embeddings != ALT.tie_word_embeddings
    assert DEFAULT.samples_per_code != ALT.samples_per_code


@pytest.mark.parametrize("name", sorted(TINY_QWEN_OMNI_SPECS))
def test_same_spec_and_seed_give_identical_bytes(name, folders, tmp_path):
    again = build_tiny_qwen2_5_omni(tmp_path / "again", TINY_QWEN_OMNI_SPECS[name])
    assert digests(again) == digests(folders[name])
    other_seed = build_tiny_qwen2_5_omni(tmp_path / "seed1", TINY_QWEN_OMNI_SPECS[name], seed=1)
    assert tensors(other_seed).keys() == tensors(again).keys()
    assert not torch.equal(
        tensors(other_seed)["talker.codec_head.weight"], tensors(again)["talker.codec_head.weight"]
    )


def test_files_and_weight_names_are_the_real_checkpoints(folders):
    default, alt = folders["default"], folders["alt"]
    index = json.loads((default / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 3  # sharded like the real one
    assert [p.name for p in alt.glob("*.safetensors")] == ["model.safetensors"]
    for folder in (default, alt):
        for name in ("config.json", "generation_config.json", "spk_dict.pt", "tokenizer.json"):
            assert (folder / name).is_file()
        keys = tensors(folder).keys()
        tops = {".".join(k.split(".")[:2]) for k in keys}
        assert tops >= {
            "thinker.model",
            "thinker.audio_tower",
            "thinker.visual",
            "talker.model",
            "talker.thinker_to_talker_proj",
            "talker.codec_head",
            "token2wav.code2wav_dit_model",
            "token2wav.code2wav_bigvgan_model",
        }
        assert "thinker.model.layers.0.self_attn.q_proj.weight" in keys
        assert not any(k.startswith("thinker.model.language_model.") for k in keys)
        assert all(t.dtype == torch.float32 for t in tensors(folder).values())
    assert "thinker.lm_head.weight" in tensors(default)
    assert "thinker.lm_head.weight" not in tensors(alt)  # tied to the embedding


@pytest.mark.parametrize("name", sorted(TINY_QWEN_OMNI_SPECS))
def test_token_ids_voices_and_tokenizer_fit_together(name, folders):
    from tokenizers import Tokenizer

    spec, folder = TINY_QWEN_OMNI_SPECS[name], folders[name]
    config = json.loads((folder / "config.json").read_text())
    thinker, talker = config["thinker_config"], config["talker_config"]
    dit = config["token2wav_config"]["dit_config"]
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert tokenizer.get_vocab_size() <= thinker["text_config"]["vocab_size"] == spec.vocab_size
    assert [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    by_token = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    assert thinker["text_config"]["eos_token_id"] == by_token["<|im_end|>"]
    assert talker["tts_text_start_token_id"] == by_token["<|tts_text_bos|>"]
    assert talker["tts_text_end_token_id"] == by_token["<|tts_text_eod|>"]
    assert talker["tts_text_pad_token_id"] == by_token["<|tts_pad|>"]
    assert thinker["vision_start_token_id"] == by_token["<|vision_bos|>"]
    codec = [talker[f"tts_codec_{k}_token_id"] for k in ("pad", "start", "end", "mask")]
    assert len(set(codec)) == 4 and all(0 <= c < talker["vocab_size"] for c in codec)
    assert dit["num_embeds"] >= talker["vocab_size"]  # any code the talker emits is embeddable
    assert talker["embedding_size"] == thinker["text_config"]["hidden_size"]
    assert talker["head_dim"] * talker["num_attention_heads"] != talker["hidden_size"]
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    assert tokenizer_config["eos_token"] == "<|im_end|>"

    voices = torch.load(folder / "spk_dict.pt", weights_only=True)
    assert sorted(voices) == sorted(VOICES)
    assert len({v["bos_token"] for v in voices.values()}) == 2
    for name_, voice in voices.items():
        assert voice["bos_token"] == by_token[VOICES[name_]]
        assert voice["cond"].shape == (1, spec.enc_emb_dim)
        assert voice["ref_mel"].shape == (1, spec.ref_mel_frames, spec.mel_dim)
        assert voice["cond"].dtype == voice["ref_mel"].dtype == torch.float32


@pytest.mark.parametrize("name", sorted(TINY_QWEN_OMNI_SPECS))
def test_transformers_loads_every_saved_tensor(name, folders):
    model = load_model(str(folders[name].resolve()))
    state = model.state_dict()
    renames = {
        "thinker.audio_tower.": "thinker.model.audio_tower.",
        "thinker.visual.": "thinker.model.visual.",
        "thinker.model.": "thinker.model.language_model.",
    }
    saved = tensors(folders[name])
    for key, value in saved.items():
        loaded = next(
            (new + key[len(old) :] for old, new in renames.items() if key.startswith(old)), key
        )
        assert torch.equal(state[loaded], value), key
    assert len(saved) == len(dict(model.named_parameters()))  # every parameter, tied once
    assert sorted(model.speaker_map) == sorted(VOICES)
    assert model.token2wav.dtype == torch.float32


def test_chat_prompts_match_omnistages_tokenizer(folders):
    from omnistage.models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_pretrained(folders["default"])
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        assert prompt_ids(folders["default"], prompt) == tokenizer.encode_chat(messages)


def _check_data_flow(ref, model):
    """The docstring of tests/qwen2_5_omni_reference.py, position by position."""
    cfg = model.config.talker_config
    thinker_embed = model.thinker.get_input_embeddings().weight.detach()
    codec_embed = model.talker.get_input_embeddings().weight.detach()
    L, G = len(ref.prompt_ids), len(ref.thinker_ids)
    fed = ref.prompt_ids + ref.thinker_ids[:-1]
    assert torch.equal(ref.thinker_embeds, thinker_embed[fed])
    E = ref.thinker_embeds + ref.thinker_hidden
    voice_bos = ref.talker_input_text_ids[L]
    assert ref.talker_input_text_ids == ref.prompt_ids + [voice_bos, ref.thinker_ids[0]]
    mask, pad, bos = (
        cfg.tts_codec_mask_token_id,
        cfg.tts_codec_pad_token_id,
        cfg.tts_codec_start_token_id,
    )
    assert ref.talker_input_ids == [mask] * L + [pad, bos]
    expected = torch.cat([E[:L], thinker_embed[voice_bos][None], E[L : L + 1]])
    torch.testing.assert_close(ref.talker_inputs_embeds, expected, rtol=0, atol=0)
    reply = torch.cat(
        [E[L + 1 :], thinker_embed[[cfg.tts_text_end_token_id, cfg.tts_text_pad_token_id]]]
    )
    assert ref.thinker_reply_part.shape[0] == G
    torch.testing.assert_close(ref.thinker_reply_part, reply, rtol=0, atol=0)
    prefill = expected.clone()
    prefill[-2] += codec_embed[pad]
    prefill[-1] += codec_embed[bos]
    torch.testing.assert_close(ref.talker_prefill_embeds, prefill)
    assert len(ref.talker_step_embeds) == len(ref.talker_sequence) - 1
    for k, step in enumerate(ref.talker_step_embeds):
        row = reply[min(k, G - 1)]
        torch.testing.assert_close(step, codec_embed[ref.talker_sequence[k]] + row)
    # greedy choices: the thinker's plain argmax; the talker's after the repetition penalty
    # over its input ids and codes so far, with codec bos suppressed
    logits = ref.thinker_hidden[L - 1 :] @ model.thinker.lm_head.weight.detach().T
    assert logits.argmax(-1).tolist() == ref.thinker_ids
    assert len(ref.talker_logits) == len(ref.talker_sequence)
    for k, raw in enumerate(ref.talker_logits):
        seen = torch.tensor(sorted(set(ref.talker_input_ids + ref.talker_sequence[:k])))
        penalised = raw.clone()
        penalised[seen] = torch.where(raw[seen] < 0, raw[seen] * 1.05, raw[seen] / 1.05)
        penalised[bos] = -float("inf")
        assert penalised.argmax().item() == ref.talker_sequence[k]
    positions = torch.cat(ref.talker_position_ids, dim=-1)
    assert torch.equal(positions, torch.arange(L + 1 + len(ref.talker_sequence)).expand(3, -1))


@pytest.mark.parametrize("name", sorted(TINY_QWEN_OMNI_SPECS))
@pytest.mark.parametrize("prompt", PROMPTS)
def test_reference_generate_speaks(name, prompt, folders):
    spec, folder = TINY_QWEN_OMNI_SPECS[name], folders[name]
    voice = "Ethan" if prompt == PROMPTS[1] else "Chelsie"
    ref = reference_generate(
        folder,
        prompt,
        voice=voice,
        seed=7,
        thinker_max_new_tokens=8,
        talker_max_new_tokens=24,
        num_steps=4,
    )
    assert 0 < len(ref.thinker_ids) <= 8
    assert len(ref.talker_codes) >= 4  # the random talker does not stop at once
    assert all(0 <= c < spec.talker_vocab_size for c in ref.talker_codes)
    assert ref.waveform.dtype == np.float32
    assert ref.waveform.shape == (len(ref.talker_codes) * spec.samples_per_code,)
    assert np.isfinite(ref.waveform).all() and ref.waveform.std() > 0.01
    assert ref.noise_is_first_draw_after_seed
    assert ref.mel.shape == (1, spec.mel_dim, len(ref.talker_codes) * spec.dit_repeats)
    assert (
        ref.talker_input_text_ids[len(ref.prompt_ids)]
        == torch.load(folder / "spk_dict.pt", weights_only=True)[voice]["bos_token"]
    )
    _check_data_flow(ref, load_model(str(folder.resolve())))


def test_waveform_is_token2wav_of_the_codes_from_the_seeded_noise(folders):
    folder = folders["default"]
    ref = reference_generate(
        folder,
        PROMPTS[0],
        voice="Chelsie",
        seed=3,
        thinker_max_new_tokens=6,
        talker_max_new_tokens=12,
    )
    model = load_model(str(folder.resolve()))
    torch.manual_seed(3)
    with torch.no_grad():
        again = model.token2wav(
            torch.tensor([ref.talker_codes]),
            conditioning=ref.conditioning,
            reference_mel=ref.reference_mel,
            num_steps=10,
        )
    np.testing.assert_array_equal(again.numpy(), ref.waveform)
    assert torch.equal(
        ref.noise, torch.randn(ref.noise.shape, generator=torch.Generator().manual_seed(3))
    )
    other = reference_generate(
        folder,
        PROMPTS[0],
        voice="Chelsie",
        seed=4,
        thinker_max_new_tokens=6,
        talker_max_new_tokens=12,
    )
    assert other.talker_codes == ref.talker_codes  # greedy: the seed only moves the noise
    assert not np.array_equal(other.waveform, ref.waveform)


def test_without_the_codec_prefill_embeds_transformers_5_differs(folders):
    folder = folders["alt"]
    common = dict(
        voice="Ethan", seed=0, thinker_max_new_tokens=6, talker_max_new_tokens=8, num_steps=2
    )
    plain = reference_generate(folder, PROMPTS[0], codec_prefill_embeds=False, **common)
    torch.testing.assert_close(
        plain.talker_prefill_embeds, plain.talker_inputs_embeds, rtol=0, atol=0
    )
    fixed = reference_generate(folder, PROMPTS[0], **common)
    torch.testing.assert_close(
        fixed.talker_inputs_embeds, plain.talker_inputs_embeds, rtol=0, atol=0
    )
    assert not torch.equal(fixed.talker_logits[0], plain.talker_logits[0])


def test_build_is_a_preset_builder(tmp_path, monkeypatch):
    from omnistage.models import tiny

    monkeypatch.setitem(
        tiny.PRESETS, "tiny-qwen2.5-omni", "omnistage.models.qwen2_5_omni.tiny:build"
    )
    out = tiny.ensure_preset("tiny-qwen2.5-omni", tmp_path / "omni")
    assert tiny.is_built(out)
    assert json.loads((out / "config.json").read_text())["model_type"] == "qwen2_5_omni"
