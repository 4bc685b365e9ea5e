"""The media of a request, decoded under the server's policy (vLLM's, where vLLM has one).

A chat content part (``input_audio``, ``image_url``, ``audio_url``, ``video_url``) names its
media by a base64 payload, a ``data:`` URL, a ``file://`` URL under
``--allowed-local-media-path`` or an ``http(s)://`` URL on a host of
``--allowed-media-domains``; ``load_part`` fetches it (async, bounded in bytes and time, so a
slow URL holds up no other request) and decodes it off the event loop into the plain values of
``omnistage.models.media``. Every limit is checked as early as the bytes allow: a base64
payload from its length, a file from its size, a download while it streams, a duration, a
picture size or a video's decoded bytes from the container's header, before anything is
decoded. Every refusal, a limit included, is an ``InvalidRequestError`` (a 400) naming the
offending field, so a bad part is never a 500 or a hang.

Modules: ``policy`` (the flags as a ``MediaPolicy``), ``parts`` (content parts: ``load_part``,
``check_counts``), ``messages`` (chat messages with media parts: ``load_messages``), ``sources`` (data:, file://, http(s)://), ``decode`` (audio and image
bytes), ``video`` (video bytes). Media already decoded (vLLM's ``multi_modal_data``) becomes
items through ``omnistage.models.media.media_items``. Nothing here imports torch or a model.
"""

from __future__ import annotations

from omnistage.entrypoints.media.decode import decode_audio, decode_image, resample
from omnistage.entrypoints.media.messages import (
    has_media_parts,
    load_messages,
    media_part_fields,
)
from omnistage.entrypoints.media.parts import check_counts, load_part, part_modality
from omnistage.entrypoints.media.policy import MediaPolicy
from omnistage.entrypoints.media.video import decode_video

__all__ = [
    "MediaPolicy",
    "check_counts",
    "decode_audio",
    "decode_image",
    "decode_video",
    "has_media_parts",
    "load_messages",
    "media_part_fields",
    "load_part",
    "part_modality",
    "resample",
]
