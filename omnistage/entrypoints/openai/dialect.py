"""Which shape a chat reply takes, and which outputs a chat request asks for when it does not
say: OpenAI's API and vLLM-Omni's render the same stage outputs differently.

- ``openai``: one choice per sample carrying everything (``content`` the text, ``audio`` the
  speech, ``images`` the pictures); streamed, speech as ``delta.audio`` pieces.
- ``vllm-omni``: one choice per sample and output modality, all with the sample's ``index``,
  in the order text, image, audio (``content`` the text; ``content`` a list of PNG
  ``image_url`` parts; ``audio`` the speech with ``content`` null); streamed, every chunk
  tagged with a top-level ``modality``, speech in ``delta.content`` as base64, each chunk a
  file of its own.

The rule (``--chat-dialect auto``, the default): a request that carries OpenAI's ``audio``
object (a voice or a format) is in OpenAI's form and gets OpenAI's shape; any other request
gets vLLM-Omni's. For text alone the two shapes are the same but for the streamed chunks'
``modality`` tag. ``--chat-dialect openai`` or ``vllm-omni`` gives every reply one shape.

A request without ``modalities`` asks for every output the pipeline produces, as vLLM-Omni
does (text and speech from a speaking model, the picture from an image pipeline);
``--default-modalities`` sets another default.
"""

from __future__ import annotations

from typing import Any, Literal

ChatDialect = Literal["openai", "vllm-omni"]
DialectSetting = Literal["auto", "openai", "vllm-omni"]


def chat_dialect(has_openai_audio: bool, setting: str | None) -> ChatDialect:
    """The shape of one reply: ``setting`` when forced, else by the request's form."""
    if setting == "openai" or (setting != "vllm-omni" and has_openai_audio):
        return "openai"
    return "vllm-omni"


def default_modalities(state: Any, engine: Any) -> list[str]:
    """What a chat request without ``modalities`` asks for: those of
    ``--default-modalities`` this pipeline produces, else every output it produces."""
    produced = list(engine.output_modalities()) if hasattr(engine, "output_modalities") else []
    configured = getattr(state, "default_modalities", None) or []
    return [m for m in configured if m in produced] or produced or ["text"]
