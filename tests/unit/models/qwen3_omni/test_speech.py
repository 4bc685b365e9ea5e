"""Qwen3-Omni speaks a given text (``SupportsSpeech``, ``omni_speech``; the shared rules are
tested with Qwen2.5-Omni): its voices are the talker's speakers in lower case, taken in any
case; the forced reply ends with the checkpoint's ``im_end``; the prompt opens the assistant
turn its thinker-to-talker hand-off needs, after a user turn it speaks from."""

from __future__ import annotations

import pytest

from omnistage.errors import InvalidRequestError
from omnistage.models.interfaces import SpeechInput, supports_speech
from omnistage.models.omni_speech import QWEN_SYSTEM_PROMPT
from omnistage.models.qwen3_omni import FAMILY
from omnistage.models.qwen3_omni.config import CHECKPOINT, OmniTokens
from omnistage.models.tiny import ensure_preset
from omnistage.models.tokenizer import Tokenizer
from omnistage.pipelines import load_pipeline

PRESET = "tiny-qwen3-omni"


@pytest.fixture(scope="module")
def folder():
    return str(ensure_preset(PRESET, load_pipeline(PRESET).stages[0].model))


@pytest.fixture(scope="module")
def tokenizer(folder):
    return Tokenizer.from_pretrained(folder)


def test_the_voices_are_the_talkers_speakers(folder, tokenizer):
    assert supports_speech(FAMILY)
    assert FAMILY.speech_voices(folder) == ["aiden", "chelsie", "ethan"]
    prompt = FAMILY.speech_prompt(folder, tokenizer.encode, SpeechInput("Hi", voice="Aiden"))
    assert prompt["request_params"] == {"audio_params": {"voice": "aiden"}}
    with pytest.raises(InvalidRequestError, match="'aiden', 'chelsie', 'ethan'"):
        FAMILY.speech_prompt(folder, tokenizer.encode, SpeechInput("Hi", voice="vivian"))


def test_the_reply_ends_the_turn_after_a_user_turn(folder, tokenizer):
    omni = OmniTokens.from_config(CHECKPOINT.config(folder))
    prompt = FAMILY.speech_prompt(folder, tokenizer.encode, SpeechInput("Hello there."))
    assert prompt["forced_token_ids"] == [*tokenizer.encode("Hello there."), omni.im_end]
    assert prompt["messages"][0] == {"role": "system", "content": QWEN_SYSTEM_PROMPT}
    ids = tokenizer.encode_chat(prompt["messages"])
    assert ids[-3:-1] == [omni.im_start, omni.assistant]  # the head the talker takes
    assert omni.user in ids  # a user turn, whose rows the talker's prompt starts with
