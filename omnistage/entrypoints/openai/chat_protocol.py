"""The body of ``POST /v1/chat/completions`` (and of its batch route): messages with text and
media parts, OpenAI's fields and vLLM's and vLLM-Omni's extensions, each checked and a bad one
named in the 400 (see ``protocol`` for the rules every body follows)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omnistage.entrypoints.openai.protocol import (
    ImageFields,
    _SamplingFields,
    _Strict,
    field_error,
)
from omnistage.stage.ar.sampling_params import MAX_LOGPROBS

MAX_BATCH = 64  # conversations in one /v1/chat/completions/batch request

TEXT_PARTS = ("text", "input_text")
# The media parts of OpenAI's chat API and vLLM's, by the modality they carry.
MEDIA_PARTS = {
    "input_audio": "audio",
    "audio_url": "audio",
    "image_url": "image",
    "video_url": "video",
}


class ContentPart(_Strict):
    """A part of a message: text, or audio, an image or a video (``input_audio`` with its
    base64 ``data`` and ``format``; ``image_url``, ``audio_url``, ``video_url`` with a
    ``url``)."""

    type: str
    text: str = ""
    input_audio: dict[str, Any] | None = None
    image_url: dict[str, Any] | str | None = None
    audio_url: dict[str, Any] | str | None = None
    video_url: dict[str, Any] | str | None = None

    @field_validator("type")
    @classmethod
    def _known(cls, v: str) -> str:
        if v not in TEXT_PARTS and v not in MEDIA_PARTS:
            raise ValueError(
                f"{v!r} input parts are not supported; parts are of type "
                f"{[*TEXT_PARTS, *MEDIA_PARTS]}"
            )
        return v

    @model_validator(mode="after")
    def _payload_of_its_type(self) -> ContentPart:
        if self.type in MEDIA_PARTS and getattr(self, self.type) is None:
            raise ValueError(f"a part of type {self.type!r} needs its {self.type!r} field")
        return self

    @property
    def modality(self) -> str | None:
        return MEDIA_PARTS.get(self.type)


class ChatMessage(_Strict):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None
    # A conversation with tools, as the chat template renders it (never parsed here).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)

    def media_parts(self) -> list[tuple[int, ContentPart]]:
        """Its audio, image and video parts, with their index among its parts."""
        if not isinstance(self.content, list):
            return []
        return [(i, p) for i, p in enumerate(self.content) if p.modality is not None]

    def prompt_message(self) -> dict[str, Any]:
        """The message as the engine takes it: its text, or with media its parts in order
        (text parts as ``{"type": "text", "text": ...}``, media parts as sent, for
        ``load_messages`` to decode); ``tool_calls`` and ``tool_call_id`` when given."""
        tools = {
            k: v for k, v in (("tool_calls", self.tool_calls), ("tool_call_id", self.tool_call_id))
            if v is not None
        }  # fmt: skip
        if not self.media_parts():
            return {"role": self.role, "content": self.text(), **tools}
        assert isinstance(self.content, list)
        return {
            "role": self.role,
            "content": [
                p.model_dump(exclude_none=True, exclude={"text"})
                if p.modality is not None
                else {"type": "text", "text": p.text}
                for p in self.content
            ],
            **tools,
        }


# The speech formats of a chat reply, as vLLM-Omni serves them (``pcm16``: OpenAI's name of
# ``pcm``, raw 16-bit little-endian samples).
AUDIO_FORMATS = ("wav", "pcm", "pcm16", "flac", "mp3", "opus")


class AudioRequest(_Strict):
    """OpenAI's ``audio`` parameter: the voice and the format of ``message.audio.data``."""

    voice: str | None = Field(default=None, min_length=1)
    format: str = "wav"

    @field_validator("format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        if v not in AUDIO_FORMATS:
            raise ValueError(
                f"Invalid audio format {v!r}. Supported formats: {list(AUDIO_FORMATS)}"
            )
        return v


class ToolFunction(BaseModel):
    """A tool's function as the chat template reads it (keys beyond these go to the template
    too: ``transformers.utils.get_json_schema`` adds ``return``)."""

    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1)


class Tool(_Strict):
    type: Literal["function"] = "function"
    function: ToolFunction


class ChatCompletionRequest(_SamplingFields, ImageFields):
    messages: list[ChatMessage] = Field(min_length=1)
    # vLLM's: a template of the request's own (with --trust-request-chat-template), the
    # template's variables, and tools rendered into the prompt (``tool_choice: "none"``).
    chat_template: str | None = Field(default=None, min_length=1)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    modalities: list[Literal["text", "image", "audio"]] | None = None
    audio: AudioRequest | None = None
    # omnistage's extras for a speaking pipeline: its speech-token (talker) stage's sampling
    # parameters and its code2wav stage's (seed, num_steps, guidance_scale, sway_coefficient).
    talker_params: dict[str, Any] | None = None
    audio_params: dict[str, Any] | None = None
    # vLLM-Omni's: every stage's parameters in stage order (vLLM's sampling keys for a token
    # stage, diffusers' for a diffusion stage), and the voice by name (``speaker``, or
    # ``voice`` at the top level).
    sampling_params_list: list[dict[str, Any] | None] | None = None
    speaker: str | None = Field(default=None, min_length=1)
    voice: str | None = Field(default=None, min_length=1)
    # vLLM-Omni's: images per prompt of a pipeline that starts with a diffusion stage.
    num_outputs_per_prompt: int = Field(default=1, ge=1, le=8)
    # vLLM's: how the model's processor treats this request's media (e.g. fps,
    # use_audio_in_video, min_pixels, max_pixels), and how media are loaded
    # (``{"video": {"num_frames": 16}}`` or ``fps``).
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[Literal["image", "audio", "video"], dict[str, Any]] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise field_error("top_logprobs", "needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _audio_needs_the_modality(self) -> ChatCompletionRequest:
        if (
            self.audio is not None
            and self.modalities is not None
            and "audio" not in self.modalities
        ):
            raise field_error("audio", 'audio is given but modalities does not include "audio"')
        named = {
            "audio_params.voice": (self.audio_params or {}).get("voice"),
            "audio.voice": self.audio.voice if self.audio is not None else None,
            "speaker": self.speaker,
            "voice": self.voice,
        }
        given = {k: v for k, v in named.items() if v is not None}
        if len({str(v).casefold() for v in given.values()}) > 1:
            # One voice per request: never pick one of two silently.
            raise field_error(
                list(given)[-1],
                " and ".join(f"{k} ({v!r})" for k, v in given.items()) + " differ; give the "
                "voice once",
            )
        return self

    @model_validator(mode="after")
    def _media_io_kwargs_known(self) -> ChatCompletionRequest:
        for modality, kwargs in (self.media_io_kwargs or {}).items():
            allowed = ("fps", "num_frames") if modality == "video" else ()
            unknown = sorted(set(kwargs) - set(allowed))
            if unknown:
                raise field_error(
                    f"media_io_kwargs.{modality}.{unknown[0]}",
                    f"is not implemented; {modality} takes {list(allowed) or 'no options'}",
                )
            for key, value in kwargs.items():
                own = (self.mm_processor_kwargs or {}).get(key)
                if own is not None and own != value:
                    raise field_error(
                        f"media_io_kwargs.{modality}.{key}",
                        f"and mm_processor_kwargs.{key} differ; give it once",
                    )
        return self

    def media_options(self) -> dict[str, Any] | None:
        """How the media are loaded and processed: ``mm_processor_kwargs`` with the video
        sampling of ``media_io_kwargs`` (vLLM's split, one set of options here)."""
        video = (self.media_io_kwargs or {}).get("video") or {}
        if self.mm_processor_kwargs is None and not video:
            return None
        return {**(self.mm_processor_kwargs or {}), **video}

    def code2wav_params(self) -> dict[str, Any]:
        """The code2wav stage's parameters: ``audio_params``, the voice (``audio.voice``,
        vLLM-Omni's ``speaker`` or ``voice``), the request's ``seed`` for the noise unless
        ``audio_params`` has one."""
        params = dict(self.audio_params or {})
        for voice in (self.audio.voice if self.audio else None, self.speaker, self.voice):
            if voice is not None:
                params.setdefault("voice", voice)
        if self.seed is not None:
            params.setdefault("seed", self.seed)
        return params

    def token_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class BatchChatCompletionRequest(ChatCompletionRequest):
    """``POST /v1/chat/completions/batch`` (vLLM's and vLLM-Omni's): several conversations,
    every other field shared; one sample each, not streamed."""

    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(  # type: ignore[assignment]
        min_length=1, max_length=MAX_BATCH
    )

    @model_validator(mode="after")
    def _one_sample_each_whole(self) -> BatchChatCompletionRequest:
        if self.n != 1:
            raise field_error("n", "a batch answers one sample per conversation (n must be 1)")
        if self.stream:
            raise field_error("stream", "a batch's answer is not streamed")
        return self

    def conversation(self, index: int) -> ChatCompletionRequest:
        """The request of conversation ``index``: its messages, the batch's other fields."""
        fields = self.model_dump(exclude={"messages"}, exclude_unset=True)
        return ChatCompletionRequest.model_validate(
            {**fields, "messages": [m.model_dump(exclude_unset=True) for m in self.messages[index]]}
        )
