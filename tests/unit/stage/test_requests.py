"""Wire requests → AR engine requests (the diffusion half is in diffusion/test_requests.py)."""

from types import SimpleNamespace

import pytest

from omnistage.errors import InvalidRequestError
from omnistage.models.tiny import ensure_preset
from omnistage.models.tokenizer import Tokenizer
from omnistage.pipelines import cache_dir
from omnistage.stage.requests import ar_request_builder


@pytest.fixture(scope="module")
def build():
    folder = ensure_preset("demo", cache_dir() / "demo")
    return ar_request_builder(SimpleNamespace(tokenizer=Tokenizer.from_pretrained(folder)))


def test_text_and_chat_prompts_are_tokenized(build):
    text = build("a", {"prompt": "hello", "sampling_params": {"max_tokens": 3}})
    assert text.prompt_token_ids and text.sampling_params.max_tokens == 3
    chat = build("b", {"messages": [{"role": "user", "content": "hello"}]})
    assert len(chat.prompt_token_ids) > len(text.prompt_token_ids)  # the template adds roles


@pytest.mark.parametrize(
    ("data", "field"),
    [
        ({}, "prompt"),
        ({"prompt": "x", "prompt_token_ids": [1]}, "prompt"),
        ({"prompt_token_ids": [1, True]}, "prompt_token_ids"),
        ({"prompt_token_ids": "1 2"}, "prompt_token_ids"),
        ({"prompt": 5}, "prompt"),
        ({"prompt": "x", "sampling_params": {"temprature": 0}}, "sampling_params.temprature"),
        ({"prompt": "x", "sampling_params": [1]}, "sampling_params"),
        ({"prompt": "x", "colour": "red"}, "colour"),
    ],
)
def test_bad_requests_name_the_field(build, data, field):
    with pytest.raises(InvalidRequestError) as info:
        build("r", data)
    assert info.value.field == field
