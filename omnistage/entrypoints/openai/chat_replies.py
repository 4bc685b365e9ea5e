"""A chat request's collected outputs as its JSON reply, in OpenAI's shape or vLLM-Omni's
(``dialect.py`` says which and what each looks like)."""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

from omnistage.engine.outputs import OmniImage
from omnistage.entrypoints.openai.audio_deltas import audio_reply
from omnistage.entrypoints.openai.choices import (
    Choice,
    Collected,
    as_token_ids,
    chat_logprobs,
    prompt_logprobs_json,
)
from omnistage.entrypoints.openai.dialect import ChatDialect
from omnistage.entrypoints.openai.replies import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionResponse,
    now,
)

ENDED_EARLY = ("abort", "error")


def image_part(image: OmniImage) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(image.png).decode("ascii")
    return {"type": "image_url", "image_url": {"url": url}}


@dataclass(frozen=True)
class ChatContext:
    """What the reply builders need to know of the request."""

    request_id: str
    model: str
    modalities: list[str]
    dialect: ChatDialect
    audio_format: str = "wav"
    include_usage: bool = False
    as_token_ids: bool = False
    prompt_ids: list[int] | None = None  # with return_token_ids

    def logprobs(self, entries: list[Any]) -> dict[str, Any]:
        return chat_logprobs(as_token_ids(entries) if self.as_token_ids else entries)


def chat_response(collected: Collected, ctx: ChatContext) -> ChatCompletionResponse:
    choices: list[ChatChoice] = []
    for c in collected.choices:
        if ctx.dialect == "openai":
            choices.append(_openai_choice(c, ctx))
        else:
            choices.extend(_vllm_omni_choices(c, ctx))
    return ChatCompletionResponse(
        id=ctx.request_id,
        created=now(),
        model=ctx.model,
        choices=choices,
        usage=collected.usage,
        prompt_token_ids=ctx.prompt_ids,
    )


def _text_choice(c: Choice, ctx: ChatContext, message: AssistantMessage) -> ChatChoice:
    return ChatChoice(
        index=c.index,
        message=message,
        finish_reason=c.finish_reason,
        logprobs=ctx.logprobs(c.logprobs) if c.logprobs else None,
        prompt_logprobs=prompt_logprobs_json(c.prompt_logprobs) if c.prompt_logprobs else None,
        token_ids=c.token_ids if ctx.prompt_ids is not None else None,
    )


def _openai_choice(c: Choice, ctx: ChatContext) -> ChatChoice:
    message = AssistantMessage(
        content=c.text if "text" in ctx.modalities else None,
        images=[image_part(img) for img in c.images] if c.images else None,
        audio=audio_reply(c.audio[0], c.text, ctx.audio_format) if c.audio else None,
    )
    return _text_choice(c, ctx, message)


def _vllm_omni_choices(c: Choice, ctx: ChatContext) -> list[ChatChoice]:
    """A choice per output modality of the sample, text first (clients that read
    ``choices[0]`` get the text, as from vLLM-Omni)."""
    out = []
    if "text" in ctx.modalities:
        out.append(_text_choice(c, ctx, AssistantMessage(content=c.text)))
    media_end = c.finish_reason if c.finish_reason in ENDED_EARLY else "stop"
    if c.images:
        parts = [image_part(img) for img in c.images]
        out.append(
            ChatChoice(
                index=c.index, message=AssistantMessage(content=parts), finish_reason=media_end
            )
        )
    if c.audio:
        speech = audio_reply(c.audio[0], c.text, ctx.audio_format)
        out.append(
            ChatChoice(
                index=c.index,
                message=AssistantMessage(content=None, audio=speech),
                finish_reason=media_end,
            )
        )
    if not out:  # nothing came (an aborted request): its end, as a text choice says it
        out.append(_text_choice(c, ctx, AssistantMessage(content=None)))
    return out
