"""``POST /v1/completions``: one prompt or a batch of them (texts or token ids), as vLLM
takes them.

A batch's prompts run side by side, each a request of its own in the stages (``<id>-<i>``);
their choices come back prompt-major, prompt ``i``'s sample ``j`` at index ``i * n + j``
(vLLM's order, which its clients rely on), with the usage summed. A refused prompt of a batch
is named by its position (``prompt.1``) and ends the whole batch: the others are aborted.
With ``return_token_ids`` each choice carries its ``token_ids`` and its prompt's
``prompt_token_ids`` (streamed: the prompt's in a choice's first chunk, the new ones in each).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from omnistage.entrypoints.openai.choices import (
    Collected,
    as_token_ids,
    completion_logprobs,
    prompt_logprobs_json,
)
from omnistage.entrypoints.openai.disconnect import unless_disconnected
from omnistage.entrypoints.openai.protocol import CompletionRequest
from omnistage.entrypoints.openai.replies import (
    CompletionChoice,
    CompletionResponse,
    Usage,
    new_id,
    now,
)
from omnistage.entrypoints.openai.request_log import RequestLog
from omnistage.entrypoints.openai.served import check_model, preparer_of, text_stage
from omnistage.entrypoints.openai.streams import (
    SSE_RESPONSES,
    Stream,
    client_gone,
    collect_all,
    error_event,
    fingerprint,
    merged,
    primed_all,
    renamed,
    sse,
)
from omnistage.entrypoints.serve.deps import EngineClientDep

router = APIRouter(tags=["openai"])


def _at(position: int) -> Any:
    """How a batch names a refused prompt: by its position."""

    def rename(field: str) -> str | None:
        return f"prompt.{position}" if field in ("prompt", "prompt_token_ids") else None

    return rename


async def _prompt_token_ids(engine: Any, prompts: list[str | list[int]]) -> list[list[int]]:
    """Each prompt's token ids, a text's tokenized as the stage's preparer tokenized it."""
    if all(isinstance(p, list) for p in prompts):
        return [p for p in prompts if isinstance(p, list)]
    tokenizer = preparer_of(engine, text_stage(engine), "return_token_ids").tokenizer

    def encode() -> list[list[int]]:
        return [p if isinstance(p, list) else tokenizer.encode(p) for p in prompts]

    return await asyncio.to_thread(encode)


@router.post("/v1/completions", response_model=CompletionResponse, responses=SSE_RESPONSES)
async def create_completion(
    body: CompletionRequest, request: Request, engine: EngineClientDep
) -> Any:
    model = check_model(request, body.model)
    request_id = new_id("cmpl")
    prompts = body.prompts
    batched = isinstance(body.prompt, list) and not isinstance(body.prompt[0], int)
    log = RequestLog(request, request_id, "completions")
    log.received(n=body.n, stream=body.stream, **({"prompts": len(prompts)} if batched else {}))
    params = body.sampling_params(body.max_tokens)
    streams: list[Stream] = []
    for i, prompt in enumerate(prompts):
        fields = {"prompt": prompt} if isinstance(prompt, str) else {"prompt_token_ids": prompt}
        stream = engine.generate(
            fields,
            dict(params),
            ["text"],
            request_id=f"{request_id}-{i}" if batched else request_id,
        )
        streams.append(renamed(stream, _at(i)) if batched else stream)
    if body.stream:
        return await _completion_events(request, engine, body, streams, log, request_id, model)
    results = await unless_disconnected(request, collect_all(streams))
    if results is None:
        return client_gone(log)
    usage = Usage.total([r.usage for r in results])
    log.finished(results[0].finish_reason, **usage.model_dump())
    prompt_ids = await _prompt_token_ids(engine, prompts) if body.return_token_ids else None
    choices = []
    for i, (prompt, collected) in enumerate(zip(prompts, results, strict=True)):
        echo = prompt if body.echo and isinstance(prompt, str) else ""
        for c in collected.choices:
            entries: list[Any] = list(c.logprobs)
            if echo and c.prompt_logprobs:
                entries = list(c.prompt_logprobs) + entries
            if body.return_tokens_as_token_ids:
                entries = as_token_ids(entries)
            choices.append(
                CompletionChoice(
                    index=i * body.n + c.index,
                    text=echo + c.text,
                    finish_reason=c.finish_reason,
                    logprobs=completion_logprobs(entries) if body.logprobs is not None else None,
                    prompt_logprobs=(
                        prompt_logprobs_json(c.prompt_logprobs)
                        if c.prompt_logprobs and body.prompt_logprobs is not None
                        else None
                    ),
                    prompt_token_ids=prompt_ids[i] if prompt_ids is not None else None,
                    token_ids=c.token_ids if prompt_ids is not None else None,
                )
            )
    return CompletionResponse(
        id=request_id,
        created=now(),
        model=model,
        choices=choices,
        usage=usage,
        system_fingerprint=fingerprint(engine),
    )


async def _completion_events(
    request: Request,
    engine: Any,
    body: CompletionRequest,
    streams: list[Stream],
    log: RequestLog,
    request_id: str,
    model: str,
) -> Response:
    started = await unless_disconnected(request, primed_all(streams))
    if started is None:
        return client_gone(log)
    prompts = body.prompts
    prompt_ids = await _prompt_token_ids(engine, prompts) if body.return_token_ids else None
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    base = {"id": request_id, "object": "text_completion", "created": now(), "model": model}

    def chunk(index: int, text: str, finish_reason: str | None = None, **extra: Any) -> str:
        choice = {"index": index, "text": text, "finish_reason": finish_reason, **extra}
        return sse({**base, "choices": [choice]})

    async def events() -> AsyncIterator[str]:
        begun: set[int] = set()
        collected = [Collected() for _ in prompts]
        reason: str | None = None
        try:
            async for i, out in merged(started):
                collected[i].add(out)
                index = i * body.n + out.index
                if out.final:
                    reason = out.finish_reason
                extra: dict[str, Any] = {}
                if index not in begun:
                    begun.add(index)
                    first: dict[str, Any] = {}
                    if prompt_ids is not None:
                        first["prompt_token_ids"] = prompt_ids[i]
                    prompt = prompts[i]
                    if body.echo and isinstance(prompt, str):
                        yield chunk(index, prompt, **first)
                    else:
                        extra.update(first)
                if out.logprobs:
                    entries: list[Any] = list(out.logprobs)
                    if body.return_tokens_as_token_ids:
                        entries = as_token_ids(entries)
                    extra["logprobs"] = completion_logprobs(entries)
                if prompt_ids is not None and out.new_token_ids:
                    extra["token_ids"] = list(out.new_token_ids)
                if out.text_delta or out.finished or extra:
                    reason = out.finish_reason if out.finished else None
                    yield chunk(index, out.text_delta, reason, **extra)
        except Exception as exc:
            log.finished("error", error=str(exc))
            yield error_event(exc)
        else:
            log.finished(reason)
            if include_usage:
                usage = Usage.total([c.usage for c in collected])
                yield sse({**base, "choices": [], "usage": usage.model_dump()})
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
