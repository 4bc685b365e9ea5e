"""A Qwen3-TTS checkpoint's settings read from its files equal what the official ``qwen-tts``
package reads from the same files: speakers, languages, special ids, sampling defaults."""

from __future__ import annotations

import json

import pytest

from omnistage.errors import CheckpointError
from omnistage.models.qwen3_tts.config import is_tts_checkpoint, read_config
from tests.qwen3_tts_reference import qwen_tts

SPECIAL = {
    "codec_pad_id": 1000, "codec_bos_id": 1001, "codec_eos_token_id": 1002,
    "codec_think_id": 1003, "codec_nothink_id": 1004, "codec_think_bos_id": 1005,
    "codec_think_eos_id": 1006,
}  # fmt: skip


TEXT_VOCAB = 512  # the tiny tokenizer's (and the text embedding's) size


def talker_config() -> dict:
    return {
        "vocab_size": 1024 + 64, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 8, "text_vocab_size": TEXT_VOCAB, "text_hidden_size": 24, "num_code_groups": 16,
        "rope_scaling": {"rope_type": "default", "mrope_section": [2, 1, 1], "interleaved": True},
        "spk_id": {"vivian": 1010, "dylan": 1011},
        "spk_is_dialect": {"vivian": False, "dylan": "beijing_dialect"},
        "codec_language_id": {"chinese": 1020, "english": 1021, "beijing_dialect": 1022},
        "code_predictor_config": {
            "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 1,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8,
            "num_code_groups": 16,
        },
        **SPECIAL,
    }  # fmt: skip


def write_folder(folder, variant: str, size: str = "1b7", generation: dict | None = None):
    """A checkpoint's config files, written by the reference's own config classes."""
    qwen_tts()
    from qwen_tts.core import Qwen3TTSTokenizerV2Config
    from qwen_tts.core.models import Qwen3TTSConfig

    config = Qwen3TTSConfig(
        talker_config=talker_config(), tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size=size, tts_model_type=variant, im_start_token_id=190,
        im_end_token_id=191, tts_pad_token_id=192, tts_bos_token_id=193, tts_eos_token_id=194,
    )  # fmt: skip
    config.save_pretrained(folder)
    Qwen3TTSTokenizerV2Config().save_pretrained(folder / "speech_tokenizer")
    if generation is not None:
        (folder / "generation_config.json").write_text(json.dumps(generation))
    return config


@pytest.mark.parametrize("variant", ["custom_voice", "voice_design", "base"])
def test_the_settings_are_the_references(tmp_path, variant):
    reference = write_folder(tmp_path, variant, generation={"top_k": 30, "subtalker_top_p": 0.8})
    from qwen_tts.core.models import Qwen3TTSForConditionalGeneration
    from qwen_tts.inference.qwen3_tts_model import Qwen3TTSModel

    model = Qwen3TTSForConditionalGeneration(reference)
    wrapper = Qwen3TTSModel(model, None, {"top_k": 30, "subtalker_top_p": 0.8})
    ours = read_config(tmp_path)
    assert is_tts_checkpoint(tmp_path) and ours.variant == variant
    assert sorted(ours.speakers) == sorted(k.lower() for k in model.supported_speakers)
    assert ours.language_names == model.supported_languages
    assert ours.dialects == {"dylan": "beijing_dialect"}
    talker = reference.talker_config
    assert (ours.codec.eos, ours.codec.bos, ours.codec.pad) == (
        talker.codec_eos_token_id, talker.codec_bos_id, talker.codec_pad_id,
    )  # fmt: skip
    assert (ours.text.im_start, ours.text.tts_eos) == (190, 194)
    assert ours.num_code_groups == 16 and ours.codebook_size == 64
    assert dict(ours.sampling) == wrapper._merge_generate_kwargs()
    assert (ours.sample_rate, ours.samples_per_frame) == (24000, 1920)
    # the talker stage's code predictor draws as the folder's subtalker_* say
    from omnistage.models.ar_config import ARModelConfig

    talker_config = ARModelConfig.from_pretrained(tmp_path, "talker")
    assert talker_config.extras["sampling"] == wrapper._merge_generate_kwargs()


def test_the_small_custom_voice_takes_no_instruction(tmp_path):
    write_folder(tmp_path, "custom_voice", size="0b6")
    assert not read_config(tmp_path).takes_instructions
    write_folder(tmp_path, "voice_design")
    assert read_config(tmp_path).takes_instructions


def test_a_bad_checkpoint_is_named(tmp_path):
    with pytest.raises(CheckpointError, match="config.json is missing"):
        read_config(tmp_path)
    write_folder(tmp_path, "custom_voice")
    raw = json.loads((tmp_path / "config.json").read_text())
    for change, message in [
        ({"tts_model_type": "singing"}, "tts_model_type must be one of"),
        ({"model_type": "qwen2"}, "not a Qwen3-TTS checkpoint"),
        ({"im_end_token_id": "x"}, "im_end_token_id must be an integer"),
        ({"talker_config": {**raw["talker_config"], "spk_id": ["a"]}}, "spk_id must map"),
        (
            {"talker_config": {**raw["talker_config"], "spk_is_dialect": {"a": "klingon"}}},
            r"spk_is_dialect names \['klingon'\]",
        ),
    ]:
        (tmp_path / "config.json").write_text(json.dumps({**raw, **change}))
        with pytest.raises(CheckpointError, match=message):
            read_config(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "speech_tokenizer" / "config.json").write_text(
        '{"model_type": "qwen3_tts_tokenizer_25hz"}'
    )
    with pytest.raises(CheckpointError, match="the 12 Hz tokenizer"):
        read_config(tmp_path)
