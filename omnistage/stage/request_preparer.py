"""Request preparation: what runs in the API process before a request reaches a stage.

Each stage kind has a preparer (named in ``omnistage.stage.kinds``) that turns a user's
prompt into that kind's wire request, validated against what the stage reported at start-up
(its ``StageInfo``): tokenized, length-checked, parameters checked. A stage's busy loop then
only ever sees requests that fit; its own checks stay as a second line.

A request's parameters arrive by field (``sampling_params``, ``image_params``, ... in
``RequestOptions.params``); each stage takes the field its kind (or its model family, through
its ``StageInfo``) names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol

from omnistage.errors import InvalidRequestError
from omnistage.models.processors import Wants
from omnistage.stage.messages import StageRequest


@dataclass(frozen=True)
class RequestOptions:
    """The parameters of one pipeline request as the user gave them, by request field."""

    params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    @classmethod
    def of(cls, **params: Mapping[str, Any] | None) -> RequestOptions:
        """The request's ``seed`` (its ``sampling_params``') seeds every stage whose own
        parameters name none, so one seed makes the whole answer reproducible."""
        given: dict[str, Mapping[str, Any]] = {}
        sampling = params.get("sampling_params")
        seed = sampling.get("seed") if isinstance(sampling, Mapping) else None
        for name, value in params.items():
            if seed is not None and isinstance(value, Mapping | None):
                value = {"seed": seed, **(value or {})}
            if value is not None:
                given[name] = value
        return cls(given)


# vLLM's ``SamplingParams`` fields: what vLLM-Omni's ``sampling_params_list`` gives every
# stage it runs as an LLM, also those that do not sample (a code2wav stage, where vLLM-Omni
# ignores them as well).
VLLM_SAMPLING_FIELDS = frozenset(
    {
        "n", "best_of", "presence_penalty", "frequency_penalty", "repetition_penalty",
        "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
        "ignore_eos", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
        "detokenize", "skip_special_tokens", "spaces_between_special_tokens",
        "include_stop_str_in_output", "output_kind",
    }
)  # fmt: skip


class RequestPreparer(Protocol):
    PROMPT_FIELDS: ClassVar[tuple[str, ...]]  # what a prompt for this kind may hold

    @property
    def params_field(self) -> str:
        """The ``RequestOptions`` field this kind reads its parameters from."""
        ...

    def from_vllm(self, entry: Mapping[str, Any]) -> dict[str, Any]:
        """This kind's parameters from one entry of vLLM-Omni's ``sampling_params_list``
        (vLLM's sampling keys for a stage vLLM-Omni runs as an LLM, diffusers' for a
        diffusion stage). Raises ``InvalidRequestError`` naming a key it cannot take."""
        ...

    def normalize(self, options: RequestOptions) -> RequestOptions:
        """``options`` with the values this kind spells its own way in its own spelling (a
        voice named in any case: the checkpoint's name)."""
        ...

    def check_options(self, options: RequestOptions, downstream: bool = False) -> None:
        """Validate the parameters this kind takes from ``options`` (before any stage runs);
        ``downstream``: the stage is fed by another."""
        ...

    def num_samples(self, options: RequestOptions) -> int:
        """How many samples ``options`` ask of this kind (``n``)."""
        ...

    def prepare(
        self, prompt: Mapping[str, Any], options: RequestOptions, wants: Wants
    ) -> StageRequest:
        """The wire request for ``prompt`` (a mapping of ``PROMPT_FIELDS``); ``wants`` says
        what the next stage needs from this one (hidden states, token embeddings). Raises
        ``InvalidRequestError`` naming the offending field."""
        ...

    def template(self, options: RequestOptions, wants: Wants) -> StageRequest:
        """The request of a stage fed by another: the parameters of ``options``, its prompt
        left for the stage to fill from the hand-off."""
        ...


# What a prompt built for a route (a family's speech prompt, say) may carry besides its first
# stage's fields: parameters by request field that join the request's own, and the request
# field the request's ``sampling_params`` are for instead (its first stage draws nothing).
PROMPT_PARAMS = "request_params"
SAMPLING_FOR = "sampling_params_for"


def prompt_options(prompt: Any, options: RequestOptions) -> tuple[Any, RequestOptions]:
    """``prompt`` without its ``request_params`` and ``sampling_params_for``, and ``options``
    with them: ``request_params`` (``{field: {key: value}}``) join the request's own, and a
    key given both ways must agree (one value is never picked over another silently);
    ``sampling_params_for`` names the field the request's ``sampling_params`` move to (their
    ``seed`` stays, as it seeds every stage), under the same rule. Each field is a request
    field a stage reads (``talker_params``, ``audio_params``, ...)."""
    if not isinstance(prompt, Mapping) or not (PROMPT_PARAMS in prompt or SAMPLING_FOR in prompt):
        return prompt, options
    prompt = dict(prompt)
    extra = check_mapping(prompt.pop(PROMPT_PARAMS, None), PROMPT_PARAMS)
    target = prompt.pop(SAMPLING_FOR, None)
    params = {name: dict(value) for name, value in options.params.items()}
    seed = params.get("sampling_params", {}).get("seed")
    for name, value in extra.items():
        if seed is not None:  # as ``RequestOptions.of`` seeds a field given none
            params.setdefault(name, {}).setdefault("seed", seed)
        _join(params, name, dict(check_mapping(value, f"{PROMPT_PARAMS}.{name}")), PROMPT_PARAMS)
    if target is not None and target != "sampling_params":
        if not isinstance(target, str) or not target:
            raise InvalidRequestError(SAMPLING_FOR, "must name a request field")
        sampling = params.pop("sampling_params", {})
        _join(params, target, sampling, "sampling_params")
        if sampling.get("seed") is not None:
            params["sampling_params"] = {"seed": sampling["seed"]}
    return prompt, RequestOptions(params)


def _join(params: dict[str, dict[str, Any]], name: str, value: dict[str, Any], source: str) -> None:
    own = params.setdefault(name, {})
    for key, v in value.items():
        if own.get(key) is not None and v is not None and own[key] != v:
            raise InvalidRequestError(
                f"{name}.{key}", f"{v!r} ({source}) differs from the request's own {own[key]!r}"
            )
        if v is not None or key not in own:
            own[key] = v


def prompt_fields(prompt: Any, allowed: tuple[str, ...]) -> dict[str, Any]:
    """A user prompt (a string, or a mapping of ``allowed`` fields) as a dict of fields."""
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if not isinstance(prompt, Mapping):
        raise InvalidRequestError(
            "prompt", f"must be a string or an object, got {type(prompt).__name__}"
        )
    unknown = sorted(set(prompt) - set(allowed))
    if unknown:
        raise InvalidRequestError(unknown[0], f"unknown prompt field; prompts take {list(allowed)}")
    return {k: v for k, v in prompt.items() if v is not None}


def check_mapping(value: Any, field: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InvalidRequestError(field, f"must be an object, got {type(value).__name__}")
    return value
