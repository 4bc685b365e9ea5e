"""``POST /v1/chat/completions``.

The route turns the body into a pipeline request and hands its stream to a builder: a JSON
reply (``chat_replies``) or server-sent events (``chat_events``), in OpenAI's shape or
vLLM-Omni's (``dialect``). A request whose client hangs up is aborted in the stages. A
request's own chat template, its template variables, tools and ``return_token_ids`` are
rendered here (``chat_prompt``). A pipeline that starts with a diffusion stage takes the
users' text as its prompt (vLLM-Omni's image generation through chat), each of
``num_outputs_per_prompt`` images drawn with the next seed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse

from omnistage.engine.outputs import OmniRequestOutput
from omnistage.entrypoints.media import (
    MediaPolicy,
    has_media_parts,
    load_messages,
    media_part_fields,
)
from omnistage.entrypoints.openai.chat_events import chat_events
from omnistage.entrypoints.openai.chat_prompt import check_tools, needs_rendering, render_chat
from omnistage.entrypoints.openai.chat_protocol import ChatCompletionRequest
from omnistage.entrypoints.openai.chat_replies import ChatContext, chat_response
from omnistage.entrypoints.openai.dialect import chat_dialect, default_modalities
from omnistage.entrypoints.openai.disconnect import unless_disconnected
from omnistage.entrypoints.openai.replies import ChatCompletionResponse, new_id
from omnistage.entrypoints.openai.request_log import RequestLog
from omnistage.entrypoints.openai.served import check_model, takes_messages, text_stage
from omnistage.entrypoints.openai.streams import (
    SSE_RESPONSES,
    Stream,
    client_gone,
    collect,
    fingerprint,
    merged,
    named,
    primed,
    renamed,
)
from omnistage.entrypoints.serve.deps import EngineClientDep
from omnistage.errors import InvalidRequestError
from omnistage.models.media import MediaItem

router = APIRouter(tags=["openai"])


@router.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=SSE_RESPONSES)
async def create_chat_completion(
    body: ChatCompletionRequest, request: Request, engine: EngineClientDep
) -> Any:
    ctx, stream = await start_chat(body, request, engine, new_id("chatcmpl"))
    log = RequestLog(request, ctx.request_id, "chat")
    log.received(
        messages=len(body.messages), modalities=ctx.modalities, n=body.n, stream=body.stream
    )
    if body.stream:
        started = await unless_disconnected(request, primed(stream))
        if started is None:
            return client_gone(log)
        return StreamingResponse(chat_events(started, log, ctx), media_type="text/event-stream")
    collected = await unless_disconnected(request, collect(stream))
    if collected is None:
        return client_gone(log)
    log.finished(collected.finish_reason, **collected.usage.model_dump())
    answer = chat_response(collected, ctx)
    answer.system_fingerprint = fingerprint(engine)
    return answer


async def start_chat(
    body: ChatCompletionRequest, request: Request, engine: Any, request_id: str
) -> tuple[ChatContext, Stream]:
    """The reply's context and the request's stream of outputs (not started yet)."""
    state = request.app.state
    model = check_model(request, body.model)
    tools = check_tools(body)
    modalities: list[str] = list(body.modalities or default_modalities(state, engine))
    if body.audio is not None and "audio" not in modalities:
        raise InvalidRequestError(
            "audio", f"is given but the request's modalities {modalities} have no audio"
        )
    ctx = ChatContext(
        request_id=request_id,
        model=model,
        modalities=modalities,
        dialect=chat_dialect(body.audio is not None, getattr(state, "chat_dialect", None)),
        audio_format=body.audio.format if body.audio is not None else "wav",
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        as_token_ids=body.return_tokens_as_token_ids,
    )
    params: dict[str, Any] = {
        "image_params": body.image_params(body.seed),
        "stage_params": body.sampling_params_list,
        "request_id": request_id,
    }
    if "audio" in modalities:
        params.update(talker_params=body.talker_params, audio_params=body.code2wav_params())
    sampling = body.sampling_params(body.max_completion_tokens or body.max_tokens)
    if not takes_messages(engine, modalities):
        stream = _prompted(engine, _users_text(body), sampling, modalities, params, body)
    else:
        if body.num_outputs_per_prompt != 1:
            raise InvalidRequestError(
                "num_outputs_per_prompt",
                "is for pipelines that start with a diffusion stage; ask for samples with n",
            )
        namer = _body_namer(body)
        try:
            prompt, prompt_ids = await _chat_prompt(body, request, engine, modalities, tools)
        except InvalidRequestError as exc:
            raise named(exc, namer) from None
        if prompt_ids is not None and body.return_token_ids:
            ctx = dataclasses.replace(ctx, prompt_ids=prompt_ids)
        # As vLLM's chat: without a limit the answer may take the rest of the context (or
        # the stage's configured default), not SamplingParams' 16 tokens.
        sampling.setdefault("max_tokens", None)
        stream = engine.generate(prompt, sampling, modalities, **params)
        stream = renamed(stream, namer)  # a refused medium or option named as the body has it
    voice = _voice_field(body)
    if voice is not None:  # a refused voice named as the body gave it
        stream = renamed(stream, {"audio_params.voice": voice}.get)
    return ctx, stream


def _body_messages(body: ChatCompletionRequest) -> list[dict[str, Any]]:
    return [m.prompt_message() for m in body.messages]


def _body_namer(body: ChatCompletionRequest) -> Callable[[str], str | None]:
    """A stage's name for what the body gave, as the body has it: ``multi_modal_data[k]...``
    (the prompt's ``k``-th medium) is the ``k``-th media part of the messages
    (``messages.0.content.1.input_audio...``); a media option the body gave in
    ``media_io_kwargs.video`` is named there, not as the ``mm_processor_kwargs`` it joins."""
    fields = media_part_fields(_body_messages(body))
    video = (body.media_io_kwargs or {}).get("video") or {}

    def rename(field: str) -> str | None:
        match = re.match(r"multi_modal_data\[(\d+)\](.*)", field)
        if match is not None and int(match[1]) < len(fields):
            return fields[int(match[1])] + match[2]
        if field == "mm_processor_kwargs" and body.mm_processor_kwargs is None and video:
            return "media_io_kwargs"
        key = field.removeprefix("mm_processor_kwargs.")
        if key != field and isinstance(video, dict) and key in video:
            return f"media_io_kwargs.video.{key}"
        return None

    return rename


def _voice_field(body: ChatCompletionRequest) -> str | None:
    if body.audio_params is not None and "voice" in body.audio_params:
        return None
    if body.audio is not None and body.audio.voice is not None:
        return "audio.voice"
    return "speaker" if body.speaker is not None else "voice" if body.voice is not None else None


async def _chat_prompt(
    body: ChatCompletionRequest,
    request: Request,
    engine: Any,
    modalities: list[str],
    tools: list[dict[str, Any]] | None,
) -> tuple[dict[str, Any], list[int] | None]:
    """The first stage's prompt: the messages with their media loaded, or their token ids
    where the HTTP layer renders them (``chat_prompt``)."""
    messages = _body_messages(body)
    prompt: dict[str, Any] = {"messages": messages}
    media: list[MediaItem] = []
    options = body.media_options()
    if has_media_parts(messages):
        if body.return_token_ids:  # the stage expands the media's placeholders
            raise InvalidRequestError(
                "return_token_ids", "is not implemented for messages with media parts"
            )
        policy: MediaPolicy = getattr(request.app.state, "media_policy", None) or MediaPolicy()
        prompt["messages"], media = await load_messages(messages, policy, options)
    if media:
        prompt["multi_modal_data"] = media
        prompt["mm_processor_kwargs"] = {
            k: v for k, v in (options or {}).items() if k != "num_frames"
        }
    elif options:
        raise InvalidRequestError("mm_processor_kwargs", "is for messages with media parts")
    if not needs_rendering(body):
        return prompt, None
    trusted = bool(getattr(request.app.state, "trust_request_chat_template", False))
    prompt_ids = await render_chat(
        engine, text_stage(engine, modalities), body, prompt.pop("messages"), tools, trusted
    )
    prompt["prompt_token_ids"] = prompt_ids
    return prompt, prompt_ids


def _users_text(body: ChatCompletionRequest) -> str:
    """A prompt-first pipeline's prompt: the text of the user's messages, joined by spaces
    (as vLLM-Omni reads image generation through chat); media parts are not taken."""
    texts = []
    for i, message in enumerate(body.messages):
        if message.role != "user":
            continue
        for j, _ in message.media_parts():
            raise InvalidRequestError(
                f"messages.{i}.content.{j}",
                "this pipeline makes pictures from text; image edits are not served",
            )
        texts.append(message.text())
    prompt = " ".join(t for t in texts if t).strip()
    if not prompt:
        raise InvalidRequestError("messages", "no text prompt found in the user's messages")
    return prompt


def _prompted(
    engine: Any,
    prompt: str,
    sampling: dict[str, Any],
    modalities: list[str],
    params: dict[str, Any],
    body: ChatCompletionRequest,
) -> Stream:
    """``num_outputs_per_prompt`` requests of a prompt-first pipeline as one choice's
    stream (each drawn with the next seed), ending when the last ends."""
    if body.n != 1:
        raise InvalidRequestError("n", "use num_outputs_per_prompt for several images")
    token_fields = sorted(set(sampling) - {"seed"})
    if token_fields:
        raise InvalidRequestError(
            token_fields[0], "this pipeline has no token stage: it makes pictures from text"
        )
    streams = []
    for i in range(body.num_outputs_per_prompt):
        seed = None if body.seed is None else body.seed + i
        own = {**params, "image_params": body.image_params(seed)}
        own["request_id"] = f"{params['request_id']}-{i}"
        stream = engine.generate(
            prompt, {**sampling, **({"seed": seed} if seed is not None else {})}, modalities, **own
        )
        streams.append(stream)
    return _one_choice(streams)


async def _one_choice(streams: list[Stream]) -> AsyncIterator[OmniRequestOutput]:
    remaining = len(streams)
    async for _, out in merged(streams):
        if out.final:
            remaining -= 1
        out.final = out.final and remaining == 0
        yield out
