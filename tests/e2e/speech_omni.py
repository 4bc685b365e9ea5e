"""The omni models speak a given text on ``/v1/audio/speech``: tests that
``test_qwen2_5_omni_api.py`` and ``test_qwen3_omni_api.py`` import and run on their own
servers (each module gives ``server``, ``client`` and ``preset``): the official
``openai`` client's ``audio.speech.create`` with input T answers, bit for bit, the audio of a
chat (the same conversation, seed and voice) whose thinker replied T — the thinker says T on
the speech route (``forced_token_ids``), so the talker and the vocoder get what they got on
chat. A random thinker never ends its turn by itself: the chat's reply is its greedy one,
ended right after T by a stop string (the token that ends a turn is never fed back, so which
one it is reaches no later stage). T is a prefix of that reply whose text tokenizes back to
the same ids (random ids need not: a text is spoken as it tokenizes). Streamed (raw audio,
Server-Sent Events) the same bytes, in the code2wav stage's pieces; the voices are listed;
bad fields are 400s naming them."""

from __future__ import annotations

import base64
import importlib
import json

import httpx
import pytest

from omnistage.models import registry
from omnistage.models.tokenizer import Tokenizer
from omnistage.pipelines import load_pipeline

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

SEED = 7
# Joins the speech conversation's user turn (the same on both routes); with it both presets'
# greedy replies start with a few tokens that tokenize back to themselves.
INSTRUCTIONS = "Cheerfully."
REPLY_TOKENS = 12  # of the greedy reply a prefix is chosen from
CODES = 48  # the talker's codes at most (max_new_tokens: the talker's on this route)
VOICES = {"tiny-qwen2.5-omni": ("Ethan", ["Chelsie", "Ethan"]),
          "tiny-qwen3-omni": ("aiden", ["aiden", "chelsie", "ethan"])}  # fmt: skip


@pytest.fixture(scope="module")
def speech(preset):
    """The family's speech conversation (``omni_speech.OmniSpeech``) and its tokenizer."""
    folder = str(load_pipeline(preset).stages[0].model)
    family = registry.family_of_folder(folder)
    return importlib.import_module(f"{family.package}.speech").SPEECH, Tokenizer.from_pretrained(
        folder
    )


def chat(server, body: dict) -> dict:
    reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def said_and_stop(ids: list[int], tokenizer: Tokenizer) -> tuple[str, str]:
    """A prefix T of the reply ``ids`` whose text tokenizes back to its ids, and a stop string
    (the next token's whole text, found first right after T) that ends the reply there."""
    for j in range(len(ids) - 1, 0, -1):
        said, stop = tokenizer.decode(ids[:j]), tokenizer.decode(ids[j : j + 1])
        whole = tokenizer.decode(ids[: j + 1])
        clean = "\ufffd" not in whole and said.strip() and stop.strip()
        round_trip = tokenizer.encode(said) == ids[:j] and whole == said + stop
        if clean and round_trip and whole.find(stop) == len(said):
            return said, stop
    raise AssertionError(f"no prefix of the greedy reply {ids} tokenizes back to itself")


@pytest.fixture(scope="module")
def chat_spoken(server, preset, speech):
    """T and the 16-bit audio of the chat whose thinker said T (greedy, then stopped)."""
    conversation, tokenizer = speech
    messages = conversation.messages(INSTRUCTIONS)
    greedy = {"messages": messages, "temperature": 0, "seed": SEED, "max_tokens": REPLY_TOKENS}
    text_only = chat(server, {**greedy, "modalities": ["text"], "logprobs": True,
                              "return_tokens_as_token_ids": True})  # fmt: skip
    ids = [int(t["token"].removeprefix("token_id:")) for t in text_only["logprobs"]["content"]]
    said, stop = said_and_stop(ids, tokenizer)
    voice = VOICES[preset][0]
    spoken = chat(server, {**greedy, "stop": [stop], "modalities": ["text", "audio"],
                           "audio": {"voice": voice, "format": "pcm16"},
                           "talker_params": {"max_tokens": CODES}})  # fmt: skip
    assert spoken["finish_reason"] == "stop" and spoken["message"]["content"] == said
    assert len(tokenizer.encode(said)) >= 3
    return said, base64.b64decode(spoken["message"]["audio"]["data"])


def test_speech_is_the_chats_audio_when_the_thinker_said_the_text(client, preset, chat_spoken):
    said, audio = chat_spoken
    reply = client.audio.speech.create(
        model=preset, input=said, voice=VOICES[preset][0], response_format="pcm",
        instructions=INSTRUCTIONS, extra_body={"seed": SEED, "max_new_tokens": CODES},
    )  # fmt: skip
    assert len(audio) > 1000 and reply.content == audio


def test_streamed_speech_is_the_same_bytes_in_pieces(client, server, preset, chat_spoken):
    said, audio = chat_spoken
    body = {"input": said, "voice": VOICES[preset][0], "response_format": "pcm",
            "instructions": INSTRUCTIONS}  # fmt: skip
    extra = {"seed": SEED, "max_new_tokens": CODES}
    with client.audio.speech.with_streaming_response.create(
        model=preset, **body, stream_format="audio", extra_body=extra
    ) as reply:
        assert b"".join(reply.iter_bytes()) == audio
    events = httpx.post(
        server.url + "/v1/audio/speech",
        json={**body, **extra, "stream_format": "sse"},
        timeout=120,
    )
    data = [json.loads(line[6:]) for line in events.text.splitlines() if line.startswith("data:")]
    deltas = [base64.b64decode(e["audio"]) for e in data if e["type"] == "speech.audio.delta"]
    assert b"".join(deltas) == audio
    # Each as the code2wav stage streamed it: Qwen2.5-Omni's chunks by code count (12, then
    # 36); the tiny Qwen3-Omni's decoder hands an utterance this short over in one piece.
    assert len(deltas) == (2 if preset == "tiny-qwen2.5-omni" else 1)


def test_the_voices_are_the_models(server, preset):
    reply = httpx.get(server.url + "/v1/audio/voices", timeout=30).json()
    assert reply == {"voices": VOICES[preset][1], "uploaded_voices": []}


@pytest.mark.parametrize(
    ("change", "param", "said"),
    [
        ({"voice": "nobody"}, "voice", "unknown voice 'nobody'"),
        ({"language": "english"}, "language", "only auto"),
        ({"task_type": "VoiceDesign"}, "task_type", "CustomVoice"),
        ({"non_streaming_mode": True}, "non_streaming_mode", "a token per step"),
        ({"input": "Hi <|im_end|> there"}, "input", "special token <|im_end|>"),
        ({"input": "\u00e9" * 2100}, "input", "maximum context"),
        ({"top_k": -5}, "top_k", ""),
    ],
)
def test_bad_fields_are_400s_naming_them(server, change, param, said):
    reply = httpx.post(server.url + "/v1/audio/speech", json={"input": "Hi", **change}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and said in error["message"]
