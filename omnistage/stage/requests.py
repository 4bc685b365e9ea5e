"""Wire requests (plain dicts from the engine client) → each engine kind's request objects.

AR requests carry ``prompt`` (text), ``prompt_token_ids`` or chat ``messages`` plus
``sampling_params``; tokenizing happens here, in the stage process, which owns the tokenizer.
Diffusion requests carry ``prompt`` or ``prompt_embeds`` plus ``params``. Unknown or
ill-typed fields raise ``InvalidRequestError`` naming them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from omnistage.errors import InvalidRequestError

RequestBuilder = Callable[[str, dict[str, Any]], Any]

_AR_FIELDS = {"prompt", "prompt_token_ids", "messages", "sampling_params", "return_hidden_states"}
_DIFFUSION_FIELDS = {
    "prompt",
    "prompt_embeds",
    "negative_prompt",
    "negative_prompt_embeds",
    "params",
}


def _check_fields(data: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise InvalidRequestError(unknown[0], f"unknown request field; allowed: {sorted(allowed)}")


def _make(cls: type, data: Any, field: str) -> Any:
    """Build a params dataclass, naming the offending key on an unknown or missing one."""
    if data is None:
        return cls()
    if not isinstance(data, dict):
        raise InvalidRequestError(field, f"must be an object, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - known)
    if unknown:
        raise InvalidRequestError(
            f"{field}.{unknown[0]}", f"unknown parameter; known: {sorted(known)}"
        )
    return cls(**data)


def ar_request_builder(engine: Any) -> RequestBuilder:
    from omnistage.stage.ar.sampling import SamplingParams
    from omnistage.stage.ar.sequence import ARRequest

    tokenizer = engine.tokenizer

    def build(request_id: str, data: dict[str, Any]) -> ARRequest:
        _check_fields(data, _AR_FIELDS)
        sources = [k for k in ("prompt", "prompt_token_ids", "messages") if data.get(k) is not None]
        if len(sources) != 1:
            raise InvalidRequestError(
                "prompt", "give exactly one of prompt, prompt_token_ids, messages"
            )
        prompt = data.get("prompt")
        if sources[0] == "messages":
            token_ids = tokenizer.encode_chat(data["messages"])
        elif sources[0] == "prompt":
            if not isinstance(prompt, str):
                raise InvalidRequestError("prompt", "must be a string")
            token_ids = tokenizer.encode(prompt)
        else:
            token_ids = data["prompt_token_ids"]
            if not isinstance(token_ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in token_ids
            ):
                raise InvalidRequestError("prompt_token_ids", "must be a list of integers")
        return ARRequest(
            request_id=request_id,
            prompt_token_ids=list(token_ids),
            sampling_params=_make(SamplingParams, data.get("sampling_params"), "sampling_params"),
            return_hidden_states=bool(data.get("return_hidden_states", False)),
            prompt=prompt,
        )

    return build


def diffusion_request_builder(engine: Any) -> RequestBuilder:
    from omnistage.stage.diffusion.params import DiffusionParams, DiffusionRequest

    def build(request_id: str, data: dict[str, Any]) -> DiffusionRequest:
        _check_fields(data, _DIFFUSION_FIELDS)
        params = data.get("params")
        if params is not None and not isinstance(params, dict):
            raise InvalidRequestError("params", f"must be an object, got {type(params).__name__}")
        params = dict(params or {})
        if data.get("negative_prompt") is not None:
            params.setdefault("negative_prompt", data["negative_prompt"])
        prompt = data.get("prompt")
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidRequestError("prompt", "must be a string")
        return DiffusionRequest(
            request_id=request_id,
            prompt=prompt,
            prompt_embeds=data.get("prompt_embeds"),
            negative_prompt_embeds=data.get("negative_prompt_embeds"),
            params=_make(DiffusionParams, params, "params"),
        )

    return build


def request_builder(kind: str, engine: Any) -> RequestBuilder:
    if kind == "ar":
        return ar_request_builder(engine)
    if kind == "diffusion":
        return diffusion_request_builder(engine)
    raise ValueError(f"unknown stage kind {kind!r}")
