"""``SamplingParams``: how one request is decoded, with vLLM's field names.

A frozen msgspec struct, so the same object is built and validated in the API process and
travels to the stage as is. Validated on construction (and again when decoded): a bad value
raises ``InvalidRequestError`` naming the field.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec

from omnistage.errors import InvalidRequestError

# Below this a temperature is greedy (as vLLM's _SAMPLING_EPS): dividing the logits by it
# would overflow to inf and make the probabilities NaN.
GREEDY_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts
MAX_COUNT = 2**63 - 1  # the largest count a stage message carries
MAX_LOGPROBS = 20  # top-k logprobs per position, as vLLM's default max_logprobs
MAX_N = 128  # samples per request
MAX_ADDITIVE_PENALTY = 2.0  # presence and frequency penalties, as OpenAI and vLLM
MAX_REPETITION_PENALTY = 100.0  # keeps the penalty finite in float32


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Decoding parameters of one request.

    ``n`` samples are drawn for the prompt, which is prefilled once: sample ``i`` draws with
    seed ``seed + i`` (so a seeded request is reproducible, and sample ``i`` equals the same
    request with ``n=1`` and that seed). ``logprobs=k`` returns, per generated token, the
    logprob and rank of the sampled token and the top ``k`` (0: the sampled token only);
    ``prompt_logprobs=k`` the same for each prompt token after the first.
    ``temperature`` 0 (or below ``GREEDY_TEMPERATURE``) is greedy. ``top_k`` 0 or -1 and
    ``top_p`` 1 disable those filters. ``max_tokens`` None means "until eos or
    ``max_model_len``". ``stop`` strings end the generation and are cut from the text;
    ``stop_token_ids`` end it and stay in the token ids (as the eos token does). ``seed``
    gives the request its own random generator, so its samples do not depend on what else
    is in the batch.

    Penalties, as vLLM (they apply to greedy requests too; each of ``n`` samples is penalised
    by its own output): ``repetition_penalty`` (> 0, at most ``MAX_REPETITION_PENALTY``; 1
    disables) divides the positive logits and multiplies the others of every token in the
    prompt or the output so far, as transformers' ``RepetitionPenaltyLogitsProcessor``;
    ``frequency_penalty`` (in [-2, 2]; 0 disables) subtracts ``penalty * count`` from each
    token's logit, ``count`` its occurrences in the output (not the prompt);
    ``presence_penalty`` (in [-2, 2]; 0 disables) subtracts ``penalty`` once from every token
    in the output. Positive values discourage repetition, negative ones encourage it.
    ``min_p`` (in [0, 1]; 0 disables) drops, after temperature, the tokens whose probability
    is below ``min_p`` times the most likely token's.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    # vLLM's: draw best_of and return the n best. Every sample drawn is returned here, so it
    # is n (or left out); RL callers pass best_of=n.
    best_of: int | None = None

    def __post_init__(self) -> None:
        if not _is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise InvalidRequestError("n", f"must be an integer in [1, {MAX_N}], got {self.n!r}")
        if self.best_of is not None and self.best_of != self.n:
            raise InvalidRequestError(
                "best_of",
                f"must equal n ({self.n}) or be left out, got {self.best_of!r}: omnistage "
                "returns every sample it draws (ask n=best_of and rank them yourself)",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not _is_int(value) or not 0 <= value <= MAX_LOGPROBS):
                raise InvalidRequestError(
                    name, f"must be an integer in [0, {MAX_LOGPROBS}] or None, got {value!r}"
                )
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                "temperature", f"must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0 <= self.min_p <= 1:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_number(value) or not -MAX_ADDITIVE_PENALTY <= value <= MAX_ADDITIVE_PENALTY:
                raise InvalidRequestError(name, f"must be in [-2, 2], got {value!r}")
        if not _is_number(self.repetition_penalty) or not (
            0 < self.repetition_penalty <= MAX_REPETITION_PENALTY
        ):
            raise InvalidRequestError(
                "repetition_penalty",
                f"must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty!r}",
            )
        if not _is_int(self.top_k) or not -1 <= self.top_k <= MAX_COUNT:
            raise InvalidRequestError(
                "top_k", f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}"
            )
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]
        ):
            raise InvalidRequestError(
                "seed", f"must be an integer in [-2**63, 2**64) or None, got {self.seed!r}"
            )
        if self.max_tokens is not None and (
            not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_COUNT
        ):
            raise InvalidRequestError(
                "max_tokens", f"must be a positive integer or None, got {self.max_tokens!r}"
            )
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= MAX_COUNT:
            raise InvalidRequestError(
                "min_tokens", f"must be a non-negative integer, got {self.min_tokens!r}"
            )
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise InvalidRequestError(
                "min_tokens", f"({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})"
            )
        for name in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(name, f"must be a boolean, got {getattr(self, name)!r}")
        _stop_strings(self.stop)
        _stop_token_ids(self.stop_token_ids)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def has_penalties(self) -> bool:
        """Whether any of the repetition, frequency and presence penalties is on."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def sample_seed(self, index: int) -> int | None:
        """The seed of sample ``index`` (``seed + index``, wrapped into the seed range)."""
        if self.seed is None:
            return None
        seed = self.seed + index
        return seed - 2**64 if seed >= SEED_RANGE[1] else seed

    @property
    def stop_strings(self) -> tuple[str, ...]:
        return _stop_strings(self.stop)

    @property
    def stop_token_id_set(self) -> frozenset[int]:
        return _stop_token_ids(self.stop_token_ids)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a plain mapping; an unknown key raises ``InvalidRequestError``."""
        if not isinstance(data, dict):
            raise InvalidRequestError(
                "sampling_params", f"must be an object, got {type(data).__name__}"
            )
        unknown = sorted(set(data) - set(cls.__struct_fields__))
        if unknown:
            raise InvalidRequestError(
                unknown[0], f"unknown sampling parameter; known: {sorted(cls.__struct_fields__)}"
            )
        return cls(**data)


def _stop_strings(stop: Any) -> tuple[str, ...]:
    if stop is None:
        return ()
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, list | tuple) or not all(isinstance(s, str) and s for s in items):
        raise InvalidRequestError("stop", "must be a non-empty string or a list of them")
    return tuple(items)


def _stop_token_ids(ids: Any) -> frozenset[int]:
    if ids is None:
        return frozenset()
    if not isinstance(ids, list | tuple) or not all(_is_int(i) and 0 <= i < 2**63 for i in ids):
        raise InvalidRequestError("stop_token_ids", "must be a list of non-negative integers")
    return frozenset(ids)
