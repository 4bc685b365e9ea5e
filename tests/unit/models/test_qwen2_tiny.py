import hashlib
import json

import pytest

from omnistage.models.ar_config import ARModelConfig
from omnistage.models.tiny import build_preset
from omnistage.models.tokenizer import Tokenizer


def _digests(folder) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(folder.iterdir())
        if f.is_file()
    }


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return build_preset("demo", tmp_path_factory.mktemp("demo-a"))


def test_same_preset_gives_same_bytes(demo, tmp_path):
    again = build_preset("demo", tmp_path / "demo-b")
    assert _digests(again) == _digests(demo)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(_digests(demo))


def test_demo_has_the_promised_shape(demo):
    config = ARModelConfig.from_pretrained(demo)
    raw = json.loads((demo / "config.json").read_text())
    assert raw["architectures"] == ["Qwen2ForCausalLM"] and raw["model_type"] == "qwen2"
    assert (config.hidden_size, config.num_hidden_layers, config.vocab_size) == (256, 4, 512)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    tokenizer = Tokenizer.from_pretrained(demo)
    assert tokenizer.vocab_size <= config.vocab_size
    assert tokenizer.backend.token_to_id("<|im_end|>") in tokenizer.eos_token_ids
