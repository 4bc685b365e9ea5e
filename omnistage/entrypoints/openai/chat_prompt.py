"""A chat request's prompt rendered in the HTTP layer, for what the stage's preparer does not
take: a template of the request's own (``chat_template``), the template's variables
(``chat_template_kwargs``), tools rendered into the prompt (``tools`` with ``tool_choice:
"none"``, as vLLM renders them), or a reply that carries the prompt's token ids
(``return_token_ids``). The same tokenizer, template engine and checks as the preparer's; the
result goes to the stage as ``prompt_token_ids``. Without any of these the messages go to
the stage as they are.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Mapping
from typing import Any

from omnistage.entrypoints.openai.chat_protocol import ChatCompletionRequest
from omnistage.entrypoints.openai.served import preparer_of
from omnistage.errors import ContextLengthError, InvalidRequestError
from omnistage.models.tokenizer import Tokenizer

# Variables the renderer sets itself: a request may not override them.
RESERVED_KWARGS = ("messages", "tools", "bos_token", "eos_token", "chat_template")
TOOL_CHOICE = "none"


def check_tools(body: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools to render, or None. Only ``tool_choice: "none"`` is implemented (the model
    sees the tools; its calls are not parsed): OpenAI's default with tools, ``"auto"``, and
    forced calls are 400s naming the field."""
    if body.tool_choice is not None and body.tool_choice != TOOL_CHOICE:
        raise InvalidRequestError(
            "tool_choice",
            f'only "{TOOL_CHOICE}" is implemented: tools are rendered into the prompt through '
            "the chat template, tool calls are not parsed from the answer",
        )
    if body.tools is None:
        return None
    if body.tool_choice is None:
        raise InvalidRequestError(
            "tools",
            f'are rendered into the prompt with tool_choice "{TOOL_CHOICE}" only (the default '
            'with tools, "auto", parses tool calls, which omnistage does not implement)',
        )
    return [tool.model_dump(exclude_none=True) for tool in body.tools] or None


def needs_rendering(body: ChatCompletionRequest) -> bool:
    return bool(
        body.chat_template is not None
        or body.chat_template_kwargs
        or body.tools
        or body.return_token_ids
    )


def template_kwargs(body: ChatCompletionRequest, trusted: bool) -> dict[str, Any]:
    """The template's variables, checked: reserved names and, unless the server trusts
    request templates (``--trust-request-chat-template``), a template of the request's own
    are refused (as vLLM refuses them)."""
    if body.chat_template is not None and not trusted:
        raise InvalidRequestError(
            "chat_template",
            "a request's own chat template is refused unless the server runs with "
            "--trust-request-chat-template",
        )
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = next((k for k in RESERVED_KWARGS if k in kwargs), None)
    if reserved is not None:
        raise InvalidRequestError(
            f"chat_template_kwargs.{reserved}",
            "is set by the server"
            + (f"; give it as the request's {reserved} field" if reserved != "messages" else ""),
        )
    if not isinstance(kwargs.setdefault("add_generation_prompt", True), bool):
        raise InvalidRequestError("chat_template_kwargs.add_generation_prompt", "must be a bool")
    return kwargs


@functools.lru_cache(maxsize=16)
def _with_template(tokenizer: Tokenizer, template: str) -> Tokenizer:
    """``tokenizer`` rendering ``template`` instead of the checkpoint's (compiled once)."""
    return Tokenizer(
        tokenizer.backend,
        chat_template=template,
        bos_token=tokenizer.bos_token,
        eos_token=tokenizer.eos_token,
    )


def _text_chars(messages: list[dict[str, Any]]) -> int:
    chars = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            chars += len(content)
        for part in content if isinstance(content, list) else ():
            if isinstance(part, Mapping) and isinstance(part.get("text"), str):
                chars += len(part["text"])
    return chars


def _too_long(max_model_len: int, what: str) -> ContextLengthError:
    return ContextLengthError(
        "messages",
        f"This model's maximum context length is {max_model_len} tokens. However, you "
        f"requested {what}, which leave no room to generate within "
        f"max_model_len={max_model_len}. Please reduce the length of the messages.",
    )


def _render(
    preparer: Any,
    messages: list[dict[str, Any]],
    template: str | None,
    tools: list[dict[str, Any]] | None,
    kwargs: dict[str, Any],
) -> list[int]:
    tokenizer: Tokenizer = preparer.tokenizer
    max_model_len: int = preparer.info.max_model_len
    # As the preparer: a text no max_model_len tokens can hold is not tokenized at all.
    chars = _text_chars(messages)
    if chars > 2 * tokenizer.max_token_chars * max_model_len:
        raise _too_long(max_model_len, f"{chars} characters")
    if template is not None:
        tokenizer = _with_template(tokenizer, template)
    if tools is not None:
        kwargs = {**kwargs, "tools": tools}
    add = kwargs.pop("add_generation_prompt")
    try:
        token_ids = tokenizer.encode_chat(messages, add_generation_prompt=add, **kwargs)
    except InvalidRequestError as exc:
        if template is None:
            raise
        raise InvalidRequestError("chat_template", exc.reason) from None  # the request's own
    if not token_ids:
        raise InvalidRequestError("messages", "the chat template rendered an empty prompt")
    if len(token_ids) >= max_model_len:
        raise _too_long(max_model_len, f"{len(token_ids)} tokens in the prompt")
    return token_ids


async def render_chat(
    engine: Any,
    stage_id: int,
    body: ChatCompletionRequest,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    trusted: bool,
) -> list[int]:
    """The prompt's token ids (``tools`` as ``check_tools`` gave them), rendered on a worker
    thread: a long chat never stalls the event loop."""
    kwargs = template_kwargs(body, trusted)
    preparer = preparer_of(engine, stage_id, "chat_template" if body.chat_template else "messages")
    return await asyncio.to_thread(_render, preparer, messages, body.chat_template, tools, kwargs)
