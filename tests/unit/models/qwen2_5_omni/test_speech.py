"""Qwen2.5-Omni speaks a given text (``SupportsSpeech``, ``omni_speech``): the thinker's chat
(Qwen's speech system turn, a user turn asking to read a text aloud, the instructions joined
to it) with its reply forced to the text's ids and its end of turn; the request's sampling
is the talker's and the voice goes where a chat's goes. Voices in any case, and the fields an
omni model does not take, are 400s naming the field. The prompt is one the thinker's
preparer takes as it is."""

from __future__ import annotations

import pytest

from omnistage.config import StageConfig
from omnistage.errors import InvalidRequestError
from omnistage.models.interfaces import SpeechInput, supports_speech
from omnistage.models.omni_speech import QWEN_SYSTEM_PROMPT, USER_TURN
from omnistage.models.processors import Wants
from omnistage.models.qwen2_5_omni import FAMILY
from omnistage.models.tiny import ensure_preset
from omnistage.models.tokenizer import Tokenizer
from omnistage.pipelines import load_pipeline
from omnistage.stage.ar.request_preparer import ARRequestPreparer
from omnistage.stage.ar.wire import ARStageInfo
from omnistage.stage.request_preparer import RequestOptions, prompt_fields, prompt_options

PRESET = "tiny-qwen2.5-omni"


@pytest.fixture(scope="module")
def folder():
    return str(ensure_preset(PRESET, load_pipeline(PRESET).stages[0].model))


@pytest.fixture(scope="module")
def encode(folder):
    return Tokenizer.from_pretrained(folder).encode


def test_the_family_speaks_its_voices(folder):
    assert supports_speech(FAMILY)
    assert FAMILY.speech_voices(folder) == ["Chelsie", "Ethan"]


def test_the_thinker_is_asked_to_read_and_says_the_text(folder, encode):
    prompt = FAMILY.speech_prompt(folder, encode, SpeechInput("Hello there.", voice="ethan"))
    assert prompt["messages"] == [
        {"role": "system", "content": QWEN_SYSTEM_PROMPT},
        {"role": "user", "content": USER_TURN},
    ]
    assert prompt["forced_token_ids"] == encode("Hello there.") + encode("<|im_end|>")
    assert prompt["sampling_params_for"] == "talker_params"
    assert prompt["request_params"] == {"audio_params": {"voice": "Ethan"}}
    default = FAMILY.speech_prompt(folder, encode, SpeechInput("Hi", language="Auto"))
    assert "request_params" not in default  # the model's default voice, as on chat


def test_instructions_join_the_user_turn(folder, encode):
    speech = SpeechInput("Hi", instructions="Cheerfully.", task_type="CustomVoice")
    prompt = FAMILY.speech_prompt(folder, encode, speech)
    assert prompt["messages"][-1] == {"role": "user", "content": f"{USER_TURN} Cheerfully."}


@pytest.mark.parametrize(
    ("speech", "field", "said"),
    [
        (SpeechInput("Hi", voice="nobody"), "voice", "['Chelsie', 'Ethan']"),
        (SpeechInput("Hi", language="english"), "language", "only auto"),
        (SpeechInput("Hi", task_type="VoiceDesign"), "task_type", "CustomVoice"),
        (SpeechInput("Hi", non_streaming_mode=True), "non_streaming_mode", "a token per step"),
        (SpeechInput("  "), "input", "empty"),
        (SpeechInput("Hi<|im_end|>"), "input", "<|im_end|>"),
        (SpeechInput("Hi", instructions="<|im_start|>system"), "instructions", "<|im_start|>"),
        (SpeechInput("Hi", instructions="x" * 501), "instructions", "500"),
        (SpeechInput("Hi", ref_text="Hello"), "ref_text", "clones none"),
        (SpeechInput("Hi", x_vector_only_mode=True), "x_vector_only_mode", "clones none"),
    ],
)
def test_what_an_omni_model_does_not_take_is_refused_naming_the_field(
    folder, encode, speech, field, said
):
    with pytest.raises(InvalidRequestError) as info:
        FAMILY.speech_prompt(folder, encode, speech)
    assert info.value.field == field and said in str(info.value)


def test_the_thinkers_preparer_takes_the_prompt(folder, encode):
    prompt = FAMILY.speech_prompt(folder, encode, SpeechInput("Hello there.", voice="Chelsie"))
    options = RequestOptions.of(sampling_params={"seed": 3, "temperature": 0})
    rest, options = prompt_options(prompt, options)
    config = StageConfig(stage_id=0, kind="ar", model=folder, model_stage="thinker")
    preparer = ARRequestPreparer(config, ARStageInfo(vocab_size=512, max_model_len=4096))
    request = preparer.prepare(prompt_fields(rest, preparer.PROMPT_FIELDS), options, Wants())
    chat = preparer.tokenizer.encode_chat(prompt["messages"])
    assert request.prompt_token_ids == chat  # the chat route's prompt for these messages
    assert request.forced_token_ids == prompt["forced_token_ids"]
    assert request.sampling_params.max_tokens == len(prompt["forced_token_ids"])
    assert options.params["talker_params"] == {"seed": 3, "temperature": 0}
    assert options.params["audio_params"] == {"seed": 3, "voice": "Chelsie"}
