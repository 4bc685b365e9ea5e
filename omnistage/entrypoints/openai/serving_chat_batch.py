"""``POST /v1/chat/completions/batch``: several conversations in one call (vLLM's route, as
vLLM-Omni serves it).

Every conversation runs as its own chat request, concurrently, with the batch's other
fields; the reply has one choice per conversation (``index`` its position) whose message
carries all its outputs (``content``, ``audio``, ``images``), and the usage summed. One
conversation refused or failed fails the batch (the others' work is aborted).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastapi import APIRouter, Request

from omnistage.entrypoints.openai.chat_protocol import BatchChatCompletionRequest
from omnistage.entrypoints.openai.chat_replies import chat_response
from omnistage.entrypoints.openai.disconnect import unless_disconnected
from omnistage.entrypoints.openai.replies import ChatCompletionResponse, Usage, new_id, now
from omnistage.entrypoints.openai.request_log import RequestLog
from omnistage.entrypoints.openai.serving_chat import start_chat
from omnistage.entrypoints.openai.streams import client_gone, collect_all, fingerprint
from omnistage.entrypoints.serve.deps import EngineClientDep

router = APIRouter(tags=["openai"])


@router.post("/v1/chat/completions/batch", response_model=ChatCompletionResponse)
async def create_batch_chat_completion(
    body: BatchChatCompletionRequest, request: Request, engine: EngineClientDep
) -> Any:
    batch_id = new_id("chatcmpl-batch")
    log = RequestLog(request, batch_id, "chat_batch")
    log.received(conversations=len(body.messages))
    started = [
        await start_chat(body.conversation(i), request, engine, f"{batch_id}-{i}")
        for i in range(len(body.messages))
    ]
    collected = await unless_disconnected(request, collect_all([s for _, s in started]))
    if collected is None:
        return client_gone(log)
    choices = []
    for i, ((ctx, _), answer) in enumerate(zip(started, collected, strict=True)):
        one = chat_response(answer, dataclasses.replace(ctx, dialect="openai"))
        choices.append(one.choices[0].model_copy(update={"index": i}))
    usage = Usage.total([answer.usage for answer in collected])
    log.finished(collected[0].finish_reason, **usage.model_dump())
    return ChatCompletionResponse(
        id=batch_id,
        created=now(),
        model=started[0][0].model,
        choices=choices,
        usage=usage,
        system_fingerprint=fingerprint(engine),
    )
