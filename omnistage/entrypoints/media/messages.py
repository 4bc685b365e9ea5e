"""Chat messages with media parts, as OpenAI and vLLM send them, made ready for a model:
each media part fetched and decoded (``load_part``), and replaced by the bare part its chat
template places the medium's placeholder for (``{"type": "audio" | "image" | "video"}``).
The HTTP chat route and the Python ``Omni`` both take messages this way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

from omnistage.entrypoints.media.parts import check_counts, load_part, part_modality
from omnistage.entrypoints.media.policy import MediaPolicy
from omnistage.models.media import MediaItem


def has_media_parts(messages: Any) -> bool:
    """Whether any message has a content part that carries media."""
    if not isinstance(messages, Sequence) or isinstance(messages, str):
        return False
    return any(
        part_modality(part) is not None
        for message in messages
        if isinstance(message, Mapping) and isinstance(message.get("content"), list)
        for part in message["content"]
    )


def media_part_fields(messages: Sequence[Mapping[str, Any]]) -> list[str]:
    """Each media part's place in the body (``messages.0.content.1.input_audio``), in the
    order ``load_messages`` gives their media: a stage's error about its ``k``-th medium
    (``multi_modal_data[k]``) names the part the client sent."""
    fields = []
    for m, message in enumerate(messages):
        content = message.get("content")
        for i, part in enumerate(content if isinstance(content, list) else []):
            if part_modality(part) is not None:
                fields.append(f"messages.{m}.content.{i}.{part.get('type')}")
    return fields


async def load_messages(
    messages: Sequence[Mapping[str, Any]],
    policy: MediaPolicy,
    options: Mapping[str, Any] | None = None,
) -> tuple[list[dict[str, Any]], list[MediaItem]]:
    """The messages with each media part replaced by its template part, and the media in
    prompt order. The parts are counted against ``--limit-mm-per-prompt`` before any is
    loaded, then loaded concurrently; one refused part stops the others' fetches."""
    out: list[dict[str, Any]] = []
    wanted: list[tuple[str, Mapping[str, Any]]] = []
    for m, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            out.append(dict(message))
            continue
        parts = []
        for i, part in enumerate(content):
            modality = part_modality(part)
            if modality is None:
                parts.append(part)
                continue
            wanted.append((f"messages.{m}.content.{i}", part))
            parts.append({"type": modality})
        out.append({**message, "content": parts})
    check_counts([str(part_modality(part)) for _, part in wanted], policy)
    loads = [
        asyncio.ensure_future(load_part(part, field, policy, options or {}))
        for field, part in wanted
    ]
    try:
        media = list(await asyncio.gather(*loads))
    finally:
        for load in loads:
            load.cancel()
    return out, media
