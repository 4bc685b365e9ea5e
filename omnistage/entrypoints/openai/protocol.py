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

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from omnistage.stage.ar.sampling_params import MAX_LOGPROBS, MAX_N


def field_error(field: str, reason: str) -> PydanticCustomError:
    """A check across a body's fields that names the one at fault: the 400's ``param`` is
    ``field`` (a model validator's own error has no field of its own: ``param`` null)."""
    return PydanticCustomError("value_error", "{reason}", {"reason": reason, "field": field})


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
                if key in merged and merged[key] is not None and merged[key] != value:
                    raise field_error(  # never one of two values picked silently
                        key,
                        f"{key} is given at the top level and in extra_body with different "
                        "values; give it once",
                    )
                if merged.get(key) is None:
                    merged[key] = value
            return merged
        return data


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


def _checked_size(size: str | None) -> str | None:
    if size is not None:
        parse_size(size)
    return size


# An image's or video's ``size`` field, ``"WIDTHxHEIGHT"`` (checked by ``parse_size``).
Size = Annotated[str | None, AfterValidator(_checked_size)]


class ImageFields(_Strict):
    """vLLM-Omni's image extras, accepted on chat and image requests: the size as ``size``
    (``"WIDTHxHEIGHT"``) or ``width`` and ``height``; ``true_cfg_scale`` where the family's
    pipeline names its classifier-free guidance so (the family's ``param_aliases``; other
    pipelines refuse it, naming themselves)."""

    size: Size = None
    width: int | None = Field(default=None, ge=1)
    height: int | None = Field(default=None, ge=1)
    num_inference_steps: int | None = Field(default=None, ge=1, le=1000)
    guidance_scale: float | None = Field(default=None, ge=0, le=100)
    true_cfg_scale: float | None = Field(default=None, ge=0, le=100)
    negative_prompt: str | None = None

    @model_validator(mode="after")
    def _one_size(self) -> ImageFields:
        sizes = (self.width, self.height)
        if self.size is not None and sizes != (None, None) and sizes != parse_size(self.size):
            raise field_error("size", "disagrees with width and height; give one")
        return self

    def image_params(self, seed: int | None) -> dict[str, Any]:
        params: dict[str, Any] = {
            "num_inference_steps": self.num_inference_steps,
            "guidance_scale": self.guidance_scale,
            "true_cfg_scale": self.true_cfg_scale,
            "seed": seed,
            "negative_prompt": self.negative_prompt,
            "width": self.width,
            "height": self.height,
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
