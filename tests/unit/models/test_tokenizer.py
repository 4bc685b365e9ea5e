import json

import pytest

from omnistage.errors import InvalidRequestError
from omnistage.models.tiny_ar import CHAT_TEMPLATE, build_tokenizer
from omnistage.models.tokenizer import IncrementalDetokenizer, Tokenizer

TEXT = "Hello wörld! 東京 café 🙂 naïve → done"


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tok")
    build_tokenizer(512).save(str(path / "tokenizer.json"))
    config = {
        "chat_template": CHAT_TEMPLATE,
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "bos_token": None,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 1]}))
    return path


@pytest.fixture(scope="module")
def tokenizer(folder):
    return Tokenizer.from_pretrained(folder)


def test_round_trip(tokenizer):
    assert tokenizer.decode(tokenizer.encode(TEXT)) == TEXT


def test_eos_ids_join_generation_config_and_tokenizer_config(tokenizer):
    assert tokenizer.eos_token_ids == {0, 1, tokenizer.backend.token_to_id("<|im_end|>")}


def test_incremental_deltas_are_whole_characters(tokenizer):
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, [5, 6])
    deltas = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(deltas) == TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d) < len(ids)  # multi-byte characters waited for more ids


def test_incremental_deltas_match_decode_of_broken_bytes(tokenizer):
    ids = [200, 45, 190, 191, 66, 230, 131, 100, 250]  # lone continuation / lead bytes
    detok = IncrementalDetokenizer(tokenizer, [])
    text = "".join(detok.push([t]) for t in ids) + detok.flush()
    assert text == tokenizer.decode(ids)


def test_prompt_ending_mid_character_does_not_swallow_output(tokenizer):
    euro_bytes = [tokenizer.backend.token_to_id(t) for t in ["â", "Ĥ", "¬"]]  # e2 82 ac
    assert tokenizer.decode(euro_bytes) == "€"
    detok = IncrementalDetokenizer(tokenizer, [5, euro_bytes[0]])
    text = "".join(detok.push([t]) for t in euro_bytes[1:] + [66]) + detok.flush()
    assert text == tokenizer.decode(euro_bytes[1:] + [66])


def test_special_tokens_are_skipped_when_asked(tokenizer):
    eos = tokenizer.backend.token_to_id("<|im_end|>")
    ids = tokenizer.encode("hi") + [eos]
    assert tokenizer.decode(ids) == "hi"
    assert tokenizer.decode(ids, skip_special_tokens=False) == "hi<|im_end|>"


def test_chat_template_renders_like_transformers(folder, tokenizer):
    from transformers import PreTrainedTokenizerFast

    reference = PreTrainedTokenizerFast.from_pretrained(folder)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi there 東京"},
    ]
    expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert tokenizer.render_chat(messages) == expected
    assert (
        tokenizer.encode_chat(messages)
        == reference(expected, add_special_tokens=False)["input_ids"]
    )


def test_template_errors_name_messages(tokenizer):
    with pytest.raises(InvalidRequestError) as info:
        tokenizer.render_chat([{"role": "user"}])
    assert info.value.field == "messages"


def test_message_the_template_cannot_join_names_messages(tokenizer):
    with pytest.raises(InvalidRequestError) as info:
        tokenizer.render_chat([{"role": "assistant", "content": None}])
    assert info.value.field == "messages"
