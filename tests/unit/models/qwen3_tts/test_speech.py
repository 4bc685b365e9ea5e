"""A speech request's prompt (``qwen3_tts.speech``), checked as vLLM-Omni's Qwen3-TTS adapter
checks it: the task is the checkpoint's; a CustomVoice request speaks a named voice (the first
speaker by default); a VoiceDesign one needs its voice described and its text whole in the
prompt; a clone's fields on another variant, or a Base request without its clip, are refused;
each refusal names the field."""

from __future__ import annotations

import pytest

from omnistage.errors import InvalidRequestError
from omnistage.models.interfaces import SpeechInput
from omnistage.models.qwen3_tts.config import read_config
from omnistage.models.qwen3_tts.speech import speech_prompt
from tests.unit.models.qwen3_tts.test_config import write_folder


def encode(text: str) -> list[int]:
    """Three role ids, one id per word, five end ids (the shape the prompt slices)."""
    return [1, 2, 3] + [10 + len(w) for w in text.split("\n")[1].split()] + [4, 5, 6, 7, 8]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_tts_speech")
    for variant in ("custom_voice", "voice_design", "base"):
        write_folder(root / variant, variant)
    return root


def test_a_custom_voice_request(folders):
    folder = str(folders / "custom_voice")
    prompt = speech_prompt(folder, encode, SpeechInput("hello there", language="English"))
    spec = prompt["prompt_spec"]
    speaker = read_config(folder).speakers["dylan"]  # the first speaker by name
    assert speaker in spec["prefix"] and spec["non_streaming_mode"] is True
    assert len(prompt["prompt_token_ids"]) == len(spec["role_ids"]) + len(spec["prefix"]) + 4
    streamed = speech_prompt(
        folder, encode, SpeechInput("hello there", voice="Vivian", non_streaming_mode=False)
    )["prompt_spec"]
    assert streamed["non_streaming_mode"] is False and 1010 in streamed["prefix"]


def test_a_voice_design_request_describes_its_voice(folders):
    folder = str(folders / "voice_design")
    speech = SpeechInput("hi you", instructions="a deep calm voice", non_streaming_mode=False)
    spec = speech_prompt(folder, encode, speech)["prompt_spec"]
    assert spec["instruct_ids"] and spec["non_streaming_mode"] is True  # always whole


@pytest.mark.parametrize(
    ("variant", "speech", "field", "said"),
    [
        ("custom_voice", SpeechInput("hi", task_type="VoiceDesign"), "task_type", "is CustomVoice"),
        ("custom_voice", SpeechInput("hi", task_type="Sing"), "task_type", "must be one of"),
        ("custom_voice", SpeechInput("   "), "input", "must not be empty"),
        ("custom_voice", SpeechInput("hi", instructions="x" * 501), "instructions", "500"),
        ("custom_voice", SpeechInput("hi", voice="nobody"), "voice", "unknown voice"),
        ("voice_design", SpeechInput("hi"), "instructions", "needs the voice described"),
        ("voice_design", SpeechInput("hi", voice="vivian", instructions="deep"), "voice",
         "from instructions"),
        ("base", SpeechInput("hi"), "ref_audio", "clones a voice"),
        ("custom_voice", SpeechInput("hi", ref_text="hello"), "ref_text", "Base checkpoint"),
        ("voice_design", SpeechInput("hi", instructions="deep", x_vector_only_mode=True),
         "x_vector_only_mode", "Base checkpoint"),
        ("custom_voice", SpeechInput("hi", speaker_embedding=(0.1,)), "speaker_embedding",
         "Base checkpoint"),
    ],
)  # fmt: skip
def test_a_bad_request_names_the_field(folders, variant, speech, field, said):
    with pytest.raises(InvalidRequestError, match=said) as info:
        speech_prompt(str(folders / variant), encode, speech)
    assert info.value.field == field
