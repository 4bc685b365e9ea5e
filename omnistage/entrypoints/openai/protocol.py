"""Request bodies of the OpenAI-compatible data routes, with vLLM's extensions RL clients send
(the replies are in ``replies``).

Honest by construction: a field omnistage does not implement (``response_format``,
``structured_outputs``, ``logit_bias``, ...) or an input part it cannot take (an image in a
message) is a 400 naming it, never silently ignored. A field sent as ``null`` asks for
nothing and is accepted (clients echo back assistant messages with ``"tool_calls": null``);
``user`` (the caller's end-user id, for their own bookkeeping) is accepted as OpenAI and vLLM
do. Known fields are validated and a bad one is named in the 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from omnistage.stage.ar.sampling import MAX_LOGPROBS, MAX_N


class _Strict(BaseModel):
    """Unknown fields are refused (400 naming them), except those sent as ``null``."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _drop_nulls(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k in cls.model_fields}
        return data


class _RequestBody(_Strict):
    """A route's whole body. ``extra_body`` (what the ``openai`` client flattens into the body,
    sent by hand as an object) is merged in, as vLLM-Omni reads it."""

    @model_validator(mode="before")
    @classmethod
    def _flatten_extra_body(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("extra_body"), dict):
            merged = {k: v for k, v in data.items() if k != "extra_body"}
            for key, value in data["extra_body"].items():
                merged.setdefault(key, value)
            return merged
        return data


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


class StreamOptions(_Strict):
    include_usage: bool = False


class _SamplingFields(_RequestBody):
    model: str | None = None
    user: str | None = None  # the caller's end-user id: accepted, not used
    max_tokens: int | None = Field(default=None, ge=1)
    min_tokens: int | None = Field(default=None, ge=0)  # vLLM's extra
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)  # vLLM's extra
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    repetition_penalty: float | None = Field(default=None, gt=0, le=100)  # vLLM's extra
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=MAX_N)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)  # vLLM's extra
    # vLLM's extra: logprob entries name tokens "token_id:<id>" instead of their text.
    return_tokens_as_token_ids: bool = False
    # vLLM's extra: each choice carries its ``token_ids``, and the reply its prompt's.
    return_token_ids: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None

    def token_logprobs(self) -> int | None:
        """``SamplingParams.logprobs`` as this route's fields ask for it."""
        return None

    def sampling_params(self, max_tokens: int | None) -> dict[str, Any]:
        params: dict[str, Any] = {
            "n": self.n if self.n != 1 else None,
            "logprobs": self.token_logprobs(),
            "prompt_logprobs": self.prompt_logprobs,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "frequency_penalty": self.frequency_penalty,
            "presence_penalty": self.presence_penalty,
            "repetition_penalty": self.repetition_penalty,
            "seed": self.seed,
            "max_tokens": max_tokens,
            "min_tokens": self.min_tokens,
            "stop": [self.stop] if isinstance(self.stop, str) else self.stop,
            "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos or None,
        }
        return {k: v for k, v in params.items() if v is not None}


class ImageFields(_Strict):
    """vLLM-Omni's image extras, accepted on chat and image requests."""

    size: str | None = None
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0)
    negative_prompt: str | None = None

    @field_validator("size")
    @classmethod
    def _check_size(cls, v: str | None) -> str | None:
        if v is not None:
            parse_size(v)
        return v

    def image_params(self, seed: int | None) -> dict[str, Any]:
        params: dict[str, Any] = {
            "num_inference_steps": self.num_inference_steps,
            "guidance_scale": self.guidance_scale,
            "seed": seed,
            "negative_prompt": self.negative_prompt,
        }
        if self.size is not None:
            params["width"], params["height"] = parse_size(self.size)
        return {k: v for k, v in params.items() if v is not None}


def parse_size(size: str) -> tuple[int, int]:
    try:
        width, height = (int(x) for x in size.lower().split("x"))
    except ValueError:
        raise ValueError(f"size must look like '64x64', got {size!r}") from None
    if width <= 0 or height <= 0:
        raise ValueError(f"size must be positive, got {size!r}")
    return width, height


class AudioRequest(_Strict):
    """OpenAI's ``audio`` parameter: the voice and the format of ``message.audio.data``."""

    voice: str | None = Field(default=None, min_length=1)
    format: Literal["wav", "pcm16"] = "wav"


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
    # vLLM's: how the model's processor treats this request's media (e.g. fps,
    # use_audio_in_video, min_pixels, max_pixels).
    mm_processor_kwargs: dict[str, Any] | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _audio_needs_the_modality(self) -> ChatCompletionRequest:
        if self.audio is not None and "audio" not in (self.modalities or []):
            raise ValueError('audio is given but modalities does not include "audio"')
        voice = (self.audio_params or {}).get("voice")
        given = self.audio.voice if self.audio is not None else None
        if given is not None and voice is not None and voice != given:
            # One voice per request: never pick one of two silently.
            raise ValueError(
                f"audio_params.voice ({voice!r}) and audio.voice ({given!r}) differ; give the "
                "voice once"
            )
        return self

    def code2wav_params(self) -> dict[str, Any]:
        """The code2wav stage's parameters: ``audio_params``, the voice of ``audio``, the
        request's ``seed`` for the noise unless ``audio_params`` has one."""
        params = dict(self.audio_params or {})
        if self.audio is not None and self.audio.voice is not None:
            params.setdefault("voice", self.audio.voice)
        if self.seed is not None:
            params.setdefault("seed", self.seed)
        return params

    def token_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_SamplingFields):
    # One prompt (a text, or token ids) or a batch of them, as vLLM takes it.
    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_shape(cls, v: Any) -> Any:
        """One error naming the field for a batch that mixes texts and token ids."""
        if isinstance(v, list) and len({type(p) for p in v}) > 1:
            raise ValueError(
                "must be a text, token ids, or a batch of texts or of token-id lists (not mixed)"
            )
        return v

    @field_validator("prompt")
    @classmethod
    def _no_empty_prompt(cls, v: Any) -> Any:
        if not v:
            raise ValueError("must not be empty")
        if isinstance(v, list) and isinstance(v[0], str | list):
            empty = next((i for i, p in enumerate(v) if not p), None)
            if empty is not None:
                raise ValueError(f"prompt {empty} of the batch is empty")
        return v

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: each a text or token ids (one for a single prompt)."""
        if isinstance(self.prompt, str) or isinstance(self.prompt[0], int):
            return [self.prompt]  # type: ignore[list-item]
        return list(self.prompt)  # type: ignore[arg-type]

    def token_logprobs(self) -> int | None:
        return self.logprobs

    def sampling_params(self, max_tokens: int | None) -> dict[str, Any]:
        params = super().sampling_params(max_tokens)
        if self.echo and self.logprobs is not None:  # the echoed prompt's logprobs too
            params.setdefault("prompt_logprobs", self.logprobs)
        return params


class ImageGenerationRequest(ImageFields, _RequestBody):
    prompt: str = Field(min_length=1)
    model: str | None = None
    user: str | None = None  # the caller's end-user id: accepted, not used
    n: int = Field(default=1, ge=1, le=8)
    response_format: Literal["b64_json"] = "b64_json"
    seed: int | None = None
