"""Reply bodies of the OpenAI-compatible data routes, with vLLM's extras (``prompt_logprobs``,
``token_ids`` and ``prompt_token_ids`` with ``return_token_ids``)."""

from __future__ import annotations

import time
import uuid
from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache served (vLLM's and OpenAI's field)


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None

    @classmethod
    def total(cls, usages: list[Usage]) -> Usage:
        """A batch's usage: the sum of its requests'."""
        details = [u.prompt_tokens_details for u in usages if u.prompt_tokens_details]
        return cls(
            prompt_tokens=sum(u.prompt_tokens for u in usages),
            completion_tokens=sum(u.completion_tokens for u in usages),
            total_tokens=sum(u.total_tokens for u in usages),
            prompt_tokens_details=PromptTokensDetails(
                cached_tokens=sum(d.cached_tokens for d in details)
            )
            if details
            else None,
        )


class AudioReply(BaseModel):
    """OpenAI's ``message.audio``: base64 ``data`` (WAV or pcm16), the text spoken."""

    id: str
    data: str
    expires_at: int
    transcript: str


class AssistantMessage(BaseModel):
    """OpenAI's shape: ``content`` is the text (a string, as OpenAI clients type it; ``None``
    when text was not asked for), generated images are PNG ``image_url`` content parts in
    ``images``, speech is ``audio``. vLLM-Omni's shape puts a choice's images in ``content``
    as those parts instead (``dialect.py``)."""

    role: Literal["assistant"] = "assistant"
    content: str | list[dict[str, Any]] | None
    images: list[dict[str, Any]] | None = None
    audio: AudioReply | None = None


ChoiceT = TypeVar("ChoiceT", bound=BaseModel)


class _Completion(BaseModel, Generic[ChoiceT]):
    """A chat or text completion reply; each kind has its own ``object`` and choices."""

    id: str
    object: str
    created: int
    model: str
    choices: list[ChoiceT]
    usage: Usage
    system_fingerprint: str | None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(_Completion[ChatChoice]):
    object: Literal["chat.completion"] = "chat.completion"
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class CompletionChoice(BaseModel):
    index: int = 0  # prompt i's sample j is i * n + j
    text: str
    finish_reason: str | None
    logprobs: dict[str, Any] | None = None
    prompt_logprobs: list[dict[str, Any] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None


class CompletionResponse(_Completion[CompletionChoice]):
    object: Literal["text_completion"] = "text_completion"


class ImageData(BaseModel):
    b64_json: str


class ImagesResponse(BaseModel):
    created: int
    data: list[ImageData]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
