"""``POST /v1/audio/speech`` (OpenAI's shape, with vLLM-Omni's extensions) and ``GET
/v1/audio/voices``: a pipeline whose first stage's model family speaks a given text
(``SupportsSpeech``) says it. The body's text, voice, language and instruction become that
stage's prompt (the family builds it; a bad one is a 400 naming the field); the talker's
sampling comes from ``temperature``, ``top_k``, ``top_p``, ``repetition_penalty``,
``max_new_tokens`` and ``seed``. The answer: the audio file, or (``stream_format``) raw audio
bytes as they come (``audio``) or Server-Sent Events (``sse``: ``speech.audio.delta`` then
``speech.audio.done``).

A cloned voice (a Base checkpoint): ``ref_audio`` (an http(s) or ``file://`` URL, a ``data:``
URI or plain base64, fetched and decoded under the chat route's media policy, at most 30 s,
resampled to 24 kHz with soxr: ``speech_clips``, the one place a clip is resolved),
``ref_text`` (its transcript: the clone in context) or ``x_vector_only_mode``; a
``speaker_embedding`` (the clip's x-vector, computed already: a clone with it alone);
or a ``voice`` uploaded through ``POST /v1/audio/voices`` (``voices.py``), whose clip and
transcript (or embedding) stand for ``ref_audio`` and ``ref_text`` (or ``speaker_embedding``). ``speed`` stretches a whole answer in
time (``audio_speed``); ``aac`` is encoded by FFmpeg (``audio_formats``). A streamed answer's
``initial_codec_chunk_frames`` (1 and up) asks the code2wav stage for an early first chunk
(``audio_params.first_chunk``: its samples not final); 0 or unset, the stage's own chunks.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import json
import math
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import Field, ValidationError, model_validator

from omnistage.engine.outputs import OmniAudio
from omnistage.entrypoints.media.policy import MediaPolicy
from omnistage.entrypoints.openai.audio_formats import encode_audio
from omnistage.entrypoints.openai.protocol import _RequestBody, field_error
from omnistage.entrypoints.openai.replies import new_id
from omnistage.entrypoints.openai.request_log import RequestLog
from omnistage.entrypoints.openai.served import check_model, ended_without
from omnistage.entrypoints.openai.speech_clips import reference
from omnistage.entrypoints.openai.streams import primed, renamed
from omnistage.entrypoints.serve.deps import EngineClientDep
from omnistage.errors import InvalidRequestError
from omnistage.models.interfaces import SpeechInput, supports_speech
from omnistage.stage.code2wav.params import MAX_FIRST_CHUNK

router = APIRouter(tags=["openai"])

MEDIA_TYPES = {
    "wav": "audio/wav",
    "pcm": "audio/pcm",
    "flac": "audio/flac",
    "mp3": "audio/mpeg",
    "opus": "audio/ogg",
    "aac": "audio/aac",
}


class SpeechRequest(_RequestBody):
    model: str | None = None
    input: str = Field(min_length=1, max_length=4096)
    voice: str | None = None
    instructions: str | None = None
    response_format: Literal["wav", "pcm", "flac", "mp3", "opus", "aac"] = "wav"
    speed: float = Field(default=1.0, ge=0.25, le=4.0)
    stream_format: Literal["sse", "audio"] | None = None
    stream: bool = False
    # vLLM-Omni's extensions
    task_type: Literal["CustomVoice", "VoiceDesign", "Base"] | None = None
    language: str | None = None
    max_new_tokens: int | None = Field(default=None, ge=1, le=4096)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    non_streaming_mode: bool | None = None
    initial_codec_chunk_frames: int | None = Field(default=None, ge=0)
    ref_audio: str | None = None
    ref_text: str | None = None
    x_vector_only_mode: bool | None = None
    speaker_embedding: list[float] | None = Field(default=None, min_length=1, max_length=8192)
    # the talker's sampling, named as on chat (temperature 0: greedy, its code predictor too)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_k: int | None = Field(default=None, ge=-1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0, le=2)

    @model_validator(mode="after")
    def _check(self) -> SpeechRequest:
        if self.streamed and self.speed != 1.0:
            raise field_error("speed", "a streamed answer is not time-stretched: 1.0, or a "
                              "whole answer")  # fmt: skip
        if self.streamed and self.response_format not in ("wav", "pcm"):
            raise field_error("response_format", "a streamed answer is wav or pcm")
        if self.speaker_embedding is not None:
            if self.ref_audio is not None:
                raise field_error("speaker_embedding", "stands for the clip's x-vector: give "
                                  "it or ref_audio, not both")  # fmt: skip
            if not all(math.isfinite(x) for x in self.speaker_embedding):
                raise field_error("speaker_embedding", "must be finite numbers")
        return self

    @property
    def streamed(self) -> bool:
        return self.stream or self.stream_format is not None

    def sampling(self) -> dict[str, Any]:
        fields = {
            "temperature": self.temperature,
            "top_k": self.top_k,
            "top_p": self.top_p,
            "repetition_penalty": self.repetition_penalty,
            "max_tokens": self.max_new_tokens,
            "seed": self.seed,
        }
        return {k: v for k, v in fields.items() if v is not None}


@functools.cache
def _tokenizer(folder: str) -> Any:
    from omnistage.models.tokenizer import Tokenizer

    return Tokenizer.from_pretrained(folder)


def speaker_of(engine: Any) -> tuple[str, Any]:
    """The first stage's folder and its family, if it speaks a given text (else a 400)."""
    folder = str(engine.config.stages[0].model)
    family = _family(folder)
    if not supports_speech(family):
        raise InvalidRequestError(
            "model", "this pipeline speaks no given text (it serves no text-to-speech model)"
        )
    return folder, family


@functools.cache
def _family(folder: str) -> Any:
    from omnistage.models import registry

    return registry.family_of_folder(folder)


@router.post("/v1/audio/speech")
async def create_speech(body: SpeechRequest, request: Request, engine: EngineClientDep) -> Any:
    check_model(request, body.model)
    log = RequestLog(request, new_id("speech"), "speech")
    log.received(format=body.response_format, stream=body.streamed)
    stream = await _speak(engine, body, log.request_id, _policy(request), _voices(request))
    stream = renamed(stream, _body_name)
    if not body.streamed:
        audio = await _at_speed(await _whole(engine, stream), body.speed)
        log.finished("stop", samples=len(audio.samples))
        return Response(
            encode_audio(audio, body.response_format), media_type=MEDIA_TYPES[body.response_format]
        )
    stream = await primed(stream)  # a refusal is a status code, not a broken stream
    if body.stream_format == "audio" or (body.stream and body.stream_format is None):
        return StreamingResponse(
            _raw(engine, stream, body.response_format), media_type=MEDIA_TYPES[body.response_format]
        )
    return StreamingResponse(
        _events(engine, stream, body.response_format), media_type="text/event-stream"
    )


async def _speak(
    engine: Any, body: SpeechRequest, request_id: str, policy: MediaPolicy, voices: Any = None
) -> AsyncIterator[Any]:
    """The pipeline's outputs for one speech request (its prompt built by the family; an
    uploaded ``voice`` in ``voices`` stands for its clip and transcript)."""
    folder, family = speaker_of(engine)
    uploaded = _uploaded(body, voices, family.speech_voices(folder))
    if uploaded is not None:
        return await _speak_uploaded(engine, body, request_id, policy, voices, uploaded)
    return await _speak_clip(engine, body, request_id, policy)


async def _speak_clip(
    engine: Any, body: SpeechRequest, request_id: str, policy: MediaPolicy,
    clip: bytes | None = None,
) -> AsyncIterator[Any]:  # fmt: skip
    """``_speak`` once the clip is known: the body's ``ref_audio``, or ``clip``'s bytes."""
    folder, family = speaker_of(engine)
    asked = body.model_dump(
        include={
            "voice", "language", "instructions", "task_type", "ref_text", "x_vector_only_mode",
        }
    )  # fmt: skip
    embedding = body.speaker_embedding
    speech = SpeechInput(
        body.input,
        speaker_embedding=None if embedding is None else tuple(embedding),
        non_streaming_mode=body.non_streaming_mode,
        ref_audio=await reference(body.ref_audio, policy, clip),
        **asked,
    )
    prompt = family.speech_prompt(folder, _tokenizer(folder).encode, speech)
    first = body.initial_codec_chunk_frames
    if first and body.streamed:  # 0 (or a whole answer): the stage's own chunks, all exact
        params = prompt.setdefault("request_params", {}).setdefault("audio_params", {})
        params["first_chunk"] = min(first, MAX_FIRST_CHUNK)  # clamped, as vLLM-Omni does
    stream: AsyncIterator[Any] = engine.generate(
        prompt, body.sampling(), ["audio"], request_id=request_id
    )
    return stream


def _policy(request: Request) -> MediaPolicy:
    """The server's media policy (the chat route's), or the defaults."""
    return getattr(request.app.state, "media_policy", None) or MediaPolicy()


class SpeechBatchRequest(_RequestBody):
    """vLLM-Omni's ``/v1/audio/speech/batch``: ``items`` (each a speech request's fields, at
    least ``input``), the other fields shared by every item (an item's own win)."""

    model: str | None = None
    items: list[dict[str, Any]] = Field(min_length=1, max_length=32)
    shared: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="before")
    @classmethod
    def _collect_shared(cls, data: Any) -> Any:
        if isinstance(data, dict):
            shared = {k: v for k, v in data.items() if k not in ("model", "items", "shared")}
            return {"model": data.get("model"), "items": data.get("items"), "shared": shared}
        return data


@router.post("/v1/audio/speech/batch")
async def create_speech_batch(
    body: SpeechBatchRequest, request: Request, engine: EngineClientDep
) -> dict[str, Any]:
    """Every item spoken at once; each answers on its own (``status`` ``success`` with its
    audio in base64, or ``error`` with the 400's message): one bad item fails only itself."""
    check_model(request, body.model)
    batch_id = new_id("speech-batch")
    policy, voices = _policy(request), _voices(request)

    async def one(index: int, item: dict[str, Any]) -> dict[str, Any]:
        try:
            speech = SpeechRequest.model_validate({**body.shared, **item})
            if speech.streamed:
                raise InvalidRequestError("stream_format", "a batch item is answered whole")
            stream = await _speak(engine, speech, f"{batch_id}-{index}", policy, voices)
            stream = renamed(stream, _body_name)
            audio = await _at_speed(await _whole(engine, stream), speech.speed)
        except (ValidationError, InvalidRequestError) as exc:
            return {"index": index, "status": "error", "error": _said(exc)}
        fmt = speech.response_format
        data = base64.b64encode(encode_audio(audio, fmt)).decode("ascii")
        return {
            "index": index,
            "status": "success",
            "audio_data": data,
            "media_type": MEDIA_TYPES[fmt],
        }

    results = await asyncio.gather(*(one(i, item) for i, item in enumerate(body.items)))
    ok = sum(r["status"] == "success" for r in results)
    return {"id": batch_id, "results": results, "total": len(results), "succeeded": ok,
            "failed": len(results) - ok}  # fmt: skip


def _said(exc: Exception) -> str:
    """A refused item's reason, as the single route's 400 words it (field: message)."""
    if isinstance(exc, ValidationError):
        err = exc.errors()[0]
        field = err.get("ctx", {}).get("field") or ".".join(str(p) for p in err["loc"])
        return f"{field}: {err['msg']}"
    return str(exc)


async def _whole(engine: Any, stream: AsyncIterator[Any]) -> OmniAudio:
    audio: OmniAudio | None = None
    last = None
    async for out in stream:
        last = out
        if out.audio:
            audio = out.audio[0]
    if audio is None:
        raise ended_without(engine, last, "speech")
    return audio


async def _pieces(engine: Any, stream: AsyncIterator[Any]) -> AsyncIterator[OmniAudio]:
    """The speech as it comes: each streamed piece, or the whole once (a stage that decodes
    whole utterances)."""
    streamed = False
    last = None
    async for out in stream:
        last = out
        for piece in out.audio_delta:
            streamed = True
            yield piece
        if out.audio and not streamed:
            yield out.audio[0]
            return
        if out.final:
            if not streamed:
                raise ended_without(engine, last, "speech")
            return


async def _raw(engine: Any, stream: AsyncIterator[Any], fmt: str) -> AsyncIterator[bytes]:
    first = True
    async for piece in _pieces(engine, stream):
        if fmt == "wav" and first:  # one header, its sizes unknown (as vLLM-Omni streams)
            yield _wav_header(piece.sample_rate)
        first = False
        yield piece.pcm16()


async def _events(engine: Any, stream: AsyncIterator[Any], fmt: str) -> AsyncIterator[bytes]:
    try:
        async for piece in _pieces(engine, stream):
            data = {
                "type": "speech.audio.delta",
                "audio": base64.b64encode(piece.pcm16()).decode(),
                "response_format": fmt,
            }
            yield f"event: speech.audio.delta\ndata: {json.dumps(data)}\n\n".encode()
        done = {"type": "speech.audio.done"}
        yield f"event: speech.audio.done\ndata: {json.dumps(done)}\n\n".encode()
    except Exception as exc:  # the stream has begun: the error goes in it
        error = {
            "type": "speech.audio.error",
            "error": {"message": str(exc), "type": "server_error"},
        }
        yield f"event: speech.audio.error\ndata: {json.dumps(error)}\n\n".encode()


def _wav_header(rate: int) -> bytes:
    """A 16-bit mono WAV header whose sizes say "unknown" (0xFFFFFFFF), for a stream."""
    import struct

    unknown = 0xFFFFFFFF
    return (
        b"RIFF" + struct.pack("<I", unknown) + b"WAVEfmt "
        + struct.pack("<IHHIIHH", 16, 1, 1, rate, rate * 2, 2, 16)
        + b"data" + struct.pack("<I", unknown)
    )  # fmt: skip


@router.get("/v1/audio/voices")
async def list_voices(request: Request, engine: EngineClientDep) -> dict[str, Any]:
    """The model's own voices, and those uploaded (``POST /v1/audio/voices``)."""
    folder, family = speaker_of(engine)
    store = _voices(request)
    uploaded = store.listed() if store is not None else []
    return {"voices": family.speech_voices(folder), "uploaded_voices": uploaded}


def _body_name(field: str) -> str | None:
    """A field a stage refused, named as the body has it: the forced reply (an omni model
    saying the text) is the ``input``, the talker's sampling its own fields, the codes a later
    stage would get (bounded by the talker's ``max_new_tokens``) that bound, the early first
    chunk ``initial_codec_chunk_frames``."""
    body = {"forced_token_ids": "input", "codes": "max_new_tokens",
            "audio_params.first_chunk": "initial_codec_chunk_frames"}.get(field)  # fmt: skip
    if body is not None:
        return body
    head, _, rest = field.partition(".")
    name = rest if head in ("talker_params", "sampling_params") and rest else field
    renamed = {"max_tokens": "max_new_tokens"}.get(name, name)
    return None if renamed == field else renamed


def _voices(request: Request) -> Any:
    """The server's uploaded voices (``voices.VoiceStore``), or None (an app without one)."""
    return getattr(request.app.state, "voice_store", None)


def _uploaded(body: SpeechRequest, voices: Any, own: list[str]) -> Any:
    """The uploaded voice ``body.voice`` names (not one of the model's own), if any; a
    request with its own ``ref_audio`` or ``speaker_embedding`` speaks that instead."""
    if voices is None or not body.voice:
        return None
    if body.ref_audio is not None or body.speaker_embedding is not None:
        return None
    if body.voice.lower() in {v.lower() for v in own}:
        return None
    return voices.get(body.voice)


async def _speak_uploaded(
    engine: Any, body: SpeechRequest, request_id: str, policy: MediaPolicy, voices: Any,
    voice: Any,
) -> AsyncIterator[Any]:  # fmt: skip
    """``_speak`` with an uploaded voice's clip (and its transcript, unless the request gives
    one or asks for the x-vector alone) or its embedding; a checkpoint that does not clone
    says so naming ``voice``."""
    update: dict[str, Any] = {"voice": None}
    clip = None
    if voice.embedding_dim:
        update["speaker_embedding"] = await asyncio.to_thread(voices.embedding, voice.name)
    else:
        clip = await asyncio.to_thread(voices.audio, voice.name)
    if not voice.embedding_dim and body.ref_text is None and not body.x_vector_only_mode:
        if voice.ref_text:
            update["ref_text"] = voice.ref_text
        else:
            update["x_vector_only_mode"] = True
    try:
        return await _speak_clip(engine, body.model_copy(update=update), request_id, policy, clip)
    except InvalidRequestError as exc:
        if exc.field in ("ref_audio", "ref_text", "x_vector_only_mode", "task_type",
                         "speaker_embedding"):  # fmt: skip
            raise InvalidRequestError(
                "voice", f"{voice.name!r} is an uploaded voice, spoken as a clone: {exc.reason}"
            ) from None
        raise


async def _at_speed(audio: OmniAudio, speed: float) -> OmniAudio:
    """``audio`` played ``speed`` times as fast at the same pitch (``audio_speed``)."""
    if speed == 1.0:
        return audio
    from omnistage.entrypoints.openai.audio_speed import time_stretch

    samples = await asyncio.to_thread(time_stretch, audio.samples, speed)
    return OmniAudio(samples, audio.sample_rate)
