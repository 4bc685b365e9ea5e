"""``POST /v1/chat/completions`` and ``POST /v1/completions``.

Each route starts the request and hands its stream to a builder: a JSON reply (collected,
one choice per sample) or server-sent events (streamed, each chunk naming its choice). A
request whose client hangs up is aborted in the stages.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from omnistage.engine.outputs import OmniAudio, OmniImage, OmniRequestOutput
from omnistage.entrypoints.media import MediaPolicy, has_media_parts, load_messages
from omnistage.entrypoints.openai.choices import (
    Collected,
    as_token_ids,
    chat_logprobs,
    completion_logprobs,
    prompt_logprobs_json,
)
from omnistage.entrypoints.openai.disconnect import unless_disconnected
from omnistage.entrypoints.openai.protocol import (
    AssistantMessage,
    AudioReply,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    new_id,
    now,
)
from omnistage.entrypoints.openai.request_log import RequestLog
from omnistage.entrypoints.serve.deps import EngineClientDep
from omnistage.entrypoints.serve.errors import error_body
from omnistage.errors import InvalidRequestError
from omnistage.models.media import MediaItem

router = APIRouter(tags=["openai"])

Stream = AsyncIterator[OmniRequestOutput]
_SSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/event-stream": {}}, "description": "With stream: true."}
}


AUDIO_CHUNK_CHARS = 64 * 1024  # base64 characters per streamed delta.audio chunk
AUDIO_TTL_S = 3600  # OpenAI's expires_at: how long a client may refer to the audio


def audio_reply(audio: OmniAudio, transcript: str, audio_format: str) -> AudioReply:
    """OpenAI's ``message.audio``: WAV (or raw pcm16) bytes, base64."""
    raw = audio.wav_bytes() if audio_format == "wav" else audio.pcm16()
    return AudioReply(
        id=new_id("audio"),
        data=base64.b64encode(raw).decode("ascii"),
        expires_at=now() + AUDIO_TTL_S,
        transcript=transcript,
    )


def image_part(image: OmniImage) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(image.png).decode("ascii")
    return {"type": "image_url", "image_url": {"url": url}}


async def _named_as_sent(stream: Stream, names: dict[str, str]) -> Stream:
    """``stream``, with a refused field named as the HTTP body has it (``audio.voice``)."""
    try:
        async for out in stream:
            yield out
    except InvalidRequestError as exc:
        if exc.field not in names:
            raise
        raise type(exc)(names[exc.field], exc.reason) from None


async def _primed(stream: Stream) -> Stream:
    """Start the stream now so admission errors (stage asleep, bad params) become a status
    code instead of a broken 200 stream."""
    first = await anext(stream)

    async def rest() -> Stream:
        yield first
        async for out in stream:
            yield out

    return rest()


async def _collect(stream: Stream) -> Collected:
    collected = Collected()
    async for out in stream:
        collected.add(out)
    return collected


def _client_gone(log: RequestLog) -> Response:
    """The reply to a client that hung up: nobody reads it; 499 shows in the access log."""
    log.finished("disconnect")
    return Response(status_code=499)


def _sse(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data)}\n\n"


def _error_event(exc: Exception) -> str:
    """A failure after the stream began, in-band, in the shape of the HTTP error reply (its
    ``code`` says whether to retry: ``stage_restarting``)."""
    return _sse(error_body(exc))


def _model_name(request: Request, asked: str | None) -> str:
    return asked or request.app.state.served_model_name


def fingerprint(engine: Any) -> str | None:
    """The weights that answered: ``weights-<version>`` after a trainer's weight sync."""
    version = engine.weight_version(0) if hasattr(engine, "weight_version") else None
    return f"weights-{version}" if version else None


# -- chat ------------------------------------------------------------------------------------


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_SSE)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, engine: EngineClientDep
) -> Any:
    request_id = new_id("chatcmpl")
    modalities: list[str] = list(body.modalities or ["text"])
    log = RequestLog(request, request_id, "chat")
    log.received(messages=len(body.messages), modalities=modalities, n=body.n, stream=body.stream)
    speech: dict[str, Any] = {}
    if "audio" in modalities:
        speech = {"talker_params": body.talker_params, "audio_params": body.code2wav_params()}
    messages = [m.prompt_message() for m in body.messages]
    prompt: dict[str, Any] = {"messages": messages}
    media: list[MediaItem] = []
    if has_media_parts(messages):
        policy: MediaPolicy = getattr(request.app.state, "media_policy", None) or MediaPolicy()
        prompt["messages"], media = await load_messages(messages, policy, body.mm_processor_kwargs)
    if media:
        prompt["multi_modal_data"] = media
        prompt["mm_processor_kwargs"] = body.mm_processor_kwargs or {}
    elif body.mm_processor_kwargs:
        raise InvalidRequestError("mm_processor_kwargs", "is for messages with media parts")
    stream = engine.generate(
        prompt,
        body.sampling_params(body.max_completion_tokens or body.max_tokens),
        modalities,
        image_params=body.image_params(body.seed),
        request_id=request_id,
        **speech,
    )
    audio_format = body.audio.format if body.audio is not None else "wav"
    if body.audio is not None and body.audio.voice is not None:
        stream = _named_as_sent(stream, {"audio_params.voice": "audio.voice"})
    model = _model_name(request, body.model)
    if body.stream:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        return await _chat_events(
            request,
            stream,
            log,
            request_id,
            model,
            include_usage,
            modalities == ["text"],
            audio_format,
        )
    reply = await _chat_reply(
        request,
        stream,
        log,
        request_id,
        model,
        modalities,
        body.return_tokens_as_token_ids,
        audio_format,
    )
    if isinstance(reply, ChatCompletionResponse):
        reply.system_fingerprint = fingerprint(engine)
    return reply


async def _chat_reply(
    request: Request,
    stream: Stream,
    log: RequestLog,
    request_id: str,
    model: str,
    modalities: list[str],
    token_ids: bool = False,
    audio_format: str = "wav",
) -> ChatCompletionResponse | Response:
    collected = await unless_disconnected(request, _collect(stream))
    if collected is None:
        return _client_gone(log)
    choices = []
    for c in collected.choices:
        message = AssistantMessage(
            content=c.text if "text" in modalities else None,
            images=[image_part(img) for img in c.images] if c.images else None,
            audio=audio_reply(c.audio[0], c.text, audio_format) if c.audio else None,
        )
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                finish_reason=c.finish_reason,
                logprobs=(
                    chat_logprobs(as_token_ids(c.logprobs) if token_ids else c.logprobs)
                    if c.logprobs
                    else None
                ),
                prompt_logprobs=(
                    prompt_logprobs_json(c.prompt_logprobs) if c.prompt_logprobs else None
                ),
            )
        )
    log.finished(collected.finish_reason, **collected.usage.model_dump())
    return ChatCompletionResponse(
        id=request_id, created=now(), model=model, choices=choices, usage=collected.usage
    )


async def _chat_events(
    request: Request,
    stream: Stream,
    log: RequestLog,
    request_id: str,
    model: str,
    include_usage: bool,
    text_only: bool,
    audio_format: str = "wav",
) -> Response:
    """Chunks per choice; a choice closes (its ``finish_reason`` chunk) when its sample is
    done — for text only, when its text is; with images, when the whole request is."""
    primed = await unless_disconnected(request, _primed(stream))
    if primed is None:
        return _client_gone(log)
    base = {"id": request_id, "object": "chat.completion.chunk", "created": now(), "model": model}

    def chunk(index: int, delta: dict[str, Any], **extra: Any) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": None, **extra}
        return _sse({**base, "choices": [choice]})

    async def events() -> AsyncIterator[str]:
        collected = Collected()
        try:
            async for out in primed:
                if out.index not in collected.by_index:
                    yield chunk(out.index, {"role": "assistant", "content": ""})
                collected.add(out)
                delta: dict[str, Any] = {}
                if out.modality == "text" and out.text_delta:
                    delta["content"] = out.text_delta
                if out.images:
                    delta["images"] = [image_part(img) for img in out.images]
                for audio in out.audio:  # as OpenAI streams it: transcript, data, expiry
                    text = collected.choice(out.index).text
                    reply = audio_reply(audio, text, audio_format)
                    yield chunk(out.index, {"audio": {"id": reply.id, "transcript": text}})
                    for start in range(0, len(reply.data), AUDIO_CHUNK_CHARS):
                        data = reply.data[start : start + AUDIO_CHUNK_CHARS]
                        yield chunk(out.index, {"audio": {"id": reply.id, "data": data}})
                    expiry = {"id": reply.id, "expires_at": reply.expires_at}
                    yield chunk(out.index, {"audio": expiry})
                extra: dict[str, Any] = {}
                if out.logprobs:
                    extra["logprobs"] = chat_logprobs(out.logprobs)
                if delta or extra:
                    yield chunk(out.index, delta, **extra)
                if out.final or (out.finished and text_only):
                    reason = collected.choice(out.index).finish_reason
                    yield chunk(out.index, {}, finish_reason=reason)
        except Exception as exc:  # mid-stream failure: tell the client in-band, then end
            log.finished("error", error=str(exc))
            yield _error_event(exc)
            yield "data: [DONE]\n\n"
            return
        log.finished(collected.finish_reason, **collected.usage.model_dump())
        if include_usage:
            yield _sse({**base, "choices": [], "usage": collected.usage.model_dump()})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


# -- completions -------------------------------------------------------------------------------


@router.post("/v1/completions", response_model=CompletionResponse, responses=_SSE)
async def create_completion(
    body: CompletionRequest, request: Request, engine: EngineClientDep
) -> Any:
    request_id = new_id("cmpl")
    log = RequestLog(request, request_id, "completions")
    log.received(n=body.n, stream=body.stream)
    prompt: dict[str, Any] = (
        {"prompt": body.prompt}
        if isinstance(body.prompt, str)
        else {"prompt_token_ids": body.prompt}
    )
    stream = engine.generate(
        prompt, body.sampling_params(body.max_tokens), ["text"], request_id=request_id
    )
    model = _model_name(request, body.model)
    echo = body.prompt if body.echo and isinstance(body.prompt, str) else ""
    if body.stream:
        return await _completion_events(request, stream, log, request_id, model, echo)
    collected = await unless_disconnected(request, _collect(stream))
    if collected is None:
        return _client_gone(log)
    log.finished(collected.finish_reason, **collected.usage.model_dump())
    choices = []
    for c in collected.choices:
        entries: list[Any] = list(c.logprobs)
        if echo and c.prompt_logprobs:
            entries = list(c.prompt_logprobs) + entries
        if body.return_tokens_as_token_ids:
            entries = as_token_ids(entries)
        choices.append(
            CompletionChoice(
                index=c.index,
                text=echo + c.text,
                finish_reason=c.finish_reason,
                logprobs=completion_logprobs(entries) if body.logprobs is not None else None,
                prompt_logprobs=(
                    prompt_logprobs_json(c.prompt_logprobs)
                    if c.prompt_logprobs and body.prompt_logprobs is not None
                    else None
                ),
            )
        )
    return CompletionResponse(
        id=request_id,
        created=now(),
        model=model,
        choices=choices,
        usage=collected.usage,
        system_fingerprint=fingerprint(engine),
    )


async def _completion_events(
    request: Request, stream: Stream, log: RequestLog, request_id: str, model: str, echo: str
) -> Response:
    primed = await unless_disconnected(request, _primed(stream))
    if primed is None:
        return _client_gone(log)
    base = {"id": request_id, "object": "text_completion", "created": now(), "model": model}

    def chunk(index: int, text: str, finish_reason: str | None = None, **extra: Any) -> str:
        choice = {"index": index, "text": text, "finish_reason": finish_reason, **extra}
        return _sse({**base, "choices": [choice]})

    async def events() -> AsyncIterator[str]:
        echoed: set[int] = set()
        reason: str | None = None
        try:
            async for out in primed:
                if out.final:
                    reason = out.finish_reason
                if echo and out.index not in echoed:
                    echoed.add(out.index)
                    yield chunk(out.index, echo)
                extra = (
                    {"logprobs": completion_logprobs(list(out.logprobs))} if out.logprobs else {}
                )
                if out.text_delta or out.finished or extra:
                    reason = out.finish_reason if out.finished else None
                    yield chunk(out.index, out.text_delta, reason, **extra)
        except Exception as exc:
            log.finished("error", error=str(exc))
            yield _error_event(exc)
        else:
            log.finished(reason)
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
