"""A chat request's outputs as server-sent events, in OpenAI's shape or vLLM-Omni's
(``dialect.py``).

Both open each choice with a role chunk (vLLM-Omni: a text choice only), send text deltas as
they come and close a choice with a ``finish_reason`` chunk when its sample is done — for
text alone, when its text is; otherwise when the whole request is. ``return_token_ids``
puts the prompt's ids on the first chunk and each chunk's new ones on it. Speech goes out as
soon as it exists: OpenAI's shape as ``delta.audio`` pieces of one file (``audio_deltas``),
vLLM-Omni's as ``delta.content`` chunks tagged ``"modality": "audio"``, each a file of its
own in the request's format, each with the usage so far. A failure after the first event is
an in-band error event, then ``[DONE]``.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import Any

from omnistage.engine.outputs import OmniAudio, OmniRequestOutput
from omnistage.entrypoints.openai.audio_deltas import AudioDeltas
from omnistage.entrypoints.openai.audio_formats import encode_audio
from omnistage.entrypoints.openai.chat_replies import ChatContext, image_part
from omnistage.entrypoints.openai.choices import Collected
from omnistage.entrypoints.openai.replies import now
from omnistage.entrypoints.openai.request_log import RequestLog
from omnistage.entrypoints.openai.streams import Stream, error_event, sse


class _Chunks:
    """Frames one chunk of the reply."""

    def __init__(self, ctx: ChatContext) -> None:
        self.ctx = ctx
        self.base = {
            "id": ctx.request_id,
            "object": "chat.completion.chunk",
            "created": now(),
            "model": ctx.model,
        }

    def chunk(
        self,
        index: int,
        delta: dict[str, Any],
        top: dict[str, Any] | None = None,
        **extra: Any,
    ) -> str:
        choice = {"index": index, "delta": delta, "finish_reason": None, **extra}
        return sse({**self.base, "choices": [choice], **(top or {})})


async def chat_events(started: Stream, log: RequestLog, ctx: ChatContext) -> AsyncIterator[str]:
    chunks = _Chunks(ctx)
    collected = Collected()
    render = _openai_chunks if ctx.dialect == "openai" else _vllm_omni_chunks
    try:
        async for piece in render(started, chunks, collected):
            yield piece
    except Exception as exc:  # mid-stream failure: tell the client in-band, then end
        log.finished("error", error=str(exc))
        yield error_event(exc)
        yield "data: [DONE]\n\n"
        return
    log.finished(collected.finish_reason, **collected.usage.model_dump())
    if ctx.include_usage:
        yield sse({**chunks.base, "choices": [], "usage": collected.usage.model_dump()})
    yield "data: [DONE]\n\n"


def _extra(out: OmniRequestOutput, ctx: ChatContext) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    if out.logprobs:
        extra["logprobs"] = ctx.logprobs(out.logprobs)
    if ctx.prompt_ids is not None and out.modality == "text" and out.new_token_ids:
        extra["token_ids"] = list(out.new_token_ids)
    return extra


def _ends_choice(out: OmniRequestOutput, ctx: ChatContext) -> bool:
    return out.final or (out.finished and ctx.modalities == ["text"])


async def _openai_chunks(
    started: Stream, chunks: _Chunks, collected: Collected
) -> AsyncIterator[str]:
    ctx = chunks.ctx
    speech = AudioDeltas(ctx.audio_format)
    async for out in started:
        if out.index not in collected.by_index:
            first = {"prompt_token_ids": ctx.prompt_ids} if ctx.prompt_ids is not None else None
            yield chunks.chunk(out.index, {"role": "assistant", "content": ""}, first)
        collected.add(out)
        delta: dict[str, Any] = {}
        if out.modality == "text" and out.text_delta:
            delta["content"] = out.text_delta
        if out.images:
            delta["images"] = [image_part(img) for img in out.images]
        text = collected.choice(out.index).text
        for audio in out.audio_delta:  # speech chunk by chunk, as soon as it exists
            for part in speech.piece(out.index, audio, text):
                yield chunks.chunk(out.index, {"audio": part})
        for audio in out.audio:  # as OpenAI streams it: transcript, data, expiry
            for part in speech.finished(out.index, audio, text):
                yield chunks.chunk(out.index, {"audio": part})
        extra = _extra(out, ctx)
        if delta or extra:
            yield chunks.chunk(out.index, delta, **extra)
        if _ends_choice(out, ctx):
            yield chunks.chunk(
                out.index, {}, finish_reason=collected.choice(out.index).finish_reason
            )


async def _vllm_omni_chunks(
    started: Stream, chunks: _Chunks, collected: Collected
) -> AsyncIterator[str]:
    ctx = chunks.ctx
    spoken: set[int] = set()  # choices whose speech went out piece by piece
    prompt_tokens = 0

    def speech_chunk(index: int, audio: OmniAudio) -> str:
        data = base64.b64encode(encode_audio(audio, ctx.audio_format)).decode("ascii")
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 0}
        usage["total_tokens"] = prompt_tokens
        delta = {"role": "assistant", "content": data}
        return chunks.chunk(index, delta, {"modality": "audio", "usage": usage})

    async for out in started:
        if out.modality == "text":
            prompt_tokens = max(prompt_tokens, out.num_prompt_tokens)
        if out.index not in collected.by_index and "text" in ctx.modalities:
            top = {"modality": "text"}
            if ctx.prompt_ids is not None:
                top["prompt_token_ids"] = ctx.prompt_ids  # type: ignore[assignment]
            yield chunks.chunk(out.index, {"role": "assistant", "content": ""}, top)
        collected.add(out)
        extra = _extra(out, ctx)
        if out.modality == "text" and (out.text_delta or extra):
            yield chunks.chunk(
                out.index, {"content": out.text_delta}, {"modality": "text"}, **extra
            )
        if out.images:
            parts = [image_part(img) for img in out.images]
            yield chunks.chunk(out.index, {"content": parts}, {"modality": "image"})
        for audio in out.audio_delta:
            if len(audio.samples):
                spoken.add(out.index)
                yield speech_chunk(out.index, audio)
        for audio in out.audio:  # the whole utterance, unless its pieces went out
            if out.index not in spoken:
                yield speech_chunk(out.index, audio)
        if _ends_choice(out, ctx):
            # Untagged, as vLLM-Omni's closing chunk: its clients skip chunks without one.
            yield chunks.chunk(
                out.index, {}, finish_reason=collected.choice(out.index).finish_reason
            )
