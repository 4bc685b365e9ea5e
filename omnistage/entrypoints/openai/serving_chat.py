"""``POST /v1/chat/completions``.

The route starts the request and hands its stream to a builder: a JSON reply (collected,
one choice per sample) or server-sent events (streamed, each chunk naming its choice). A
request whose client hangs up is aborted in the stages. A request's own chat template, its
template variables, tools and ``return_token_ids`` are rendered here (``chat_prompt``).
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from omnistage.engine.outputs import OmniImage
from omnistage.entrypoints.media import MediaPolicy, has_media_parts, load_messages
from omnistage.entrypoints.openai.audio_deltas import AudioDeltas, audio_reply
from omnistage.entrypoints.openai.chat_prompt import check_tools, needs_rendering, render_chat
from omnistage.entrypoints.openai.choices import (
    Collected,
    as_token_ids,
    chat_logprobs,
    prompt_logprobs_json,
)
from omnistage.entrypoints.openai.disconnect import unless_disconnected
from omnistage.entrypoints.openai.protocol import ChatCompletionRequest
from omnistage.entrypoints.openai.replies import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    new_id,
    now,
)
from omnistage.entrypoints.openai.request_log import RequestLog
from omnistage.entrypoints.openai.served import check_model, text_stage
from omnistage.entrypoints.openai.streams import (
    SSE_RESPONSES,
    Stream,
    client_gone,
    collect,
    error_event,
    fingerprint,
    primed,
    renamed,
    sse,
)
from omnistage.entrypoints.serve.deps import EngineClientDep
from omnistage.errors import InvalidRequestError
from omnistage.models.media import MediaItem

router = APIRouter(tags=["openai"])


def image_part(image: OmniImage) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(image.png).decode("ascii")
    return {"type": "image_url", "image_url": {"url": url}}


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=SSE_RESPONSES)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, engine: EngineClientDep
) -> Any:
    model = check_model(request, body.model)
    tools = check_tools(body)
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
        if body.return_token_ids:  # the stage expands the media's placeholders
            raise InvalidRequestError(
                "return_token_ids", "is not implemented for messages with media parts"
            )
        policy: MediaPolicy = getattr(request.app.state, "media_policy", None) or MediaPolicy()
        prompt["messages"], media = await load_messages(messages, policy, body.mm_processor_kwargs)
    if media:
        prompt["multi_modal_data"] = media
        prompt["mm_processor_kwargs"] = body.mm_processor_kwargs or {}
    elif body.mm_processor_kwargs:
        raise InvalidRequestError("mm_processor_kwargs", "is for messages with media parts")
    prompt_ids: list[int] | None = None
    if needs_rendering(body):
        trusted = bool(getattr(request.app.state, "trust_request_chat_template", False))
        stage_id = text_stage(engine, modalities)
        prompt_ids = await render_chat(
            engine, stage_id, body, prompt.pop("messages"), tools, trusted
        )
        prompt["prompt_token_ids"] = prompt_ids
    stream = engine.generate(
        prompt,
        body.sampling_params(body.max_completion_tokens or body.max_tokens),
        modalities,
        image_params=body.image_params(body.seed),
        request_id=request_id,
        **speech,
    )
    if body.audio is not None and body.audio.voice is not None:
        names = {"audio_params.voice": "audio.voice"}
        stream = renamed(stream, names.get)
    reply = _Reply(body, request_id, model, modalities, prompt_ids)
    if body.stream:
        return await _chat_events(request, stream, log, reply)
    answer = await _chat_reply(request, stream, log, reply)
    if isinstance(answer, ChatCompletionResponse):
        answer.system_fingerprint = fingerprint(engine)
    return answer


class _Reply:
    """What the reply builders need to know of the request."""

    def __init__(
        self,
        body: ChatCompletionRequest,
        request_id: str,
        model: str,
        modalities: list[str],
        prompt_ids: list[int] | None,
    ) -> None:
        self.request_id = request_id
        self.model = model
        self.modalities = modalities
        self.as_token_ids = body.return_tokens_as_token_ids
        self.prompt_ids = prompt_ids if body.return_token_ids else None
        self.audio_format = body.audio.format if body.audio is not None else "wav"
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)

    def logprobs(self, entries: list[Any]) -> dict[str, Any]:
        return chat_logprobs(as_token_ids(entries) if self.as_token_ids else entries)


async def _chat_reply(
    request: Request, stream: Stream, log: RequestLog, reply: _Reply
) -> ChatCompletionResponse | Response:
    collected = await unless_disconnected(request, collect(stream))
    if collected is None:
        return client_gone(log)
    choices = []
    for c in collected.choices:
        message = AssistantMessage(
            content=c.text if "text" in reply.modalities else None,
            images=[image_part(img) for img in c.images] if c.images else None,
            audio=audio_reply(c.audio[0], c.text, reply.audio_format) if c.audio else None,
        )
        choices.append(
            ChatChoice(
                index=c.index,
                message=message,
                finish_reason=c.finish_reason,
                logprobs=reply.logprobs(c.logprobs) if c.logprobs else None,
                prompt_logprobs=(
                    prompt_logprobs_json(c.prompt_logprobs) if c.prompt_logprobs else None
                ),
                token_ids=c.token_ids if reply.prompt_ids is not None else None,
            )
        )
    log.finished(collected.finish_reason, **collected.usage.model_dump())
    return ChatCompletionResponse(
        id=reply.request_id,
        created=now(),
        model=reply.model,
        choices=choices,
        usage=collected.usage,
        prompt_token_ids=reply.prompt_ids,
    )


async def _chat_events(
    request: Request, stream: Stream, log: RequestLog, reply: _Reply
) -> Response:
    """Chunks per choice; a choice closes (its ``finish_reason`` chunk) when its sample is
    done — for text only, when its text is; with images, when the whole request is. With
    ``return_token_ids``, the first chunk carries the prompt's ids and each its new ones."""
    started = await unless_disconnected(request, primed(stream))
    if started is None:
        return client_gone(log)
    base = {
        "id": reply.request_id,
        "object": "chat.completion.chunk",
        "created": now(),
        "model": reply.model,
    }
    text_only = reply.modalities == ["text"]
    with_ids = reply.prompt_ids is not None

    def chunk(
        index: int, delta: dict[str, Any], top: dict[str, Any] | None = None, **extra: Any
    ) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": None, **extra}
        return sse({**base, "choices": [choice], **(top or {})})

    async def events() -> AsyncIterator[str]:
        collected = Collected()
        speech = AudioDeltas(reply.audio_format)
        try:
            async for out in started:
                if out.index not in collected.by_index:
                    first = {"prompt_token_ids": reply.prompt_ids} if with_ids else None
                    yield chunk(out.index, {"role": "assistant", "content": ""}, first)
                collected.add(out)
                delta: dict[str, Any] = {}
                if out.modality == "text" and out.text_delta:
                    delta["content"] = out.text_delta
                if out.images:
                    delta["images"] = [image_part(img) for img in out.images]
                text = collected.choice(out.index).text
                for audio in out.audio_delta:  # speech chunk by chunk, as soon as it exists
                    for part in speech.piece(out.index, audio, text):
                        yield chunk(out.index, {"audio": part})
                for audio in out.audio:  # as OpenAI streams it: transcript, data, expiry
                    for part in speech.finished(out.index, audio, text):
                        yield chunk(out.index, {"audio": part})
                extra: dict[str, Any] = {}
                if out.logprobs:
                    extra["logprobs"] = reply.logprobs(out.logprobs)
                if with_ids and out.modality == "text" and out.new_token_ids:
                    extra["token_ids"] = list(out.new_token_ids)
                if delta or extra:
                    yield chunk(out.index, delta, **extra)
                if out.final or (out.finished and text_only):
                    reason = collected.choice(out.index).finish_reason
                    yield chunk(out.index, {}, finish_reason=reason)
        except Exception as exc:  # mid-stream failure: tell the client in-band, then end
            log.finished("error", error=str(exc))
            yield error_event(exc)
            yield "data: [DONE]\n\n"
            return
        log.finished(collected.finish_reason, **collected.usage.model_dump())
        if reply.include_usage:
            yield sse({**base, "choices": [], "usage": collected.usage.model_dump()})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
