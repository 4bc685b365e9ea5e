"""``SamplingParams``: how one request is decoded, with vLLM's field names.

Validated on construction: a bad value raises ``InvalidRequestError`` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from omnistage.errors import InvalidRequestError

# Below this a temperature is greedy (as vLLM's _SAMPLING_EPS): dividing the logits by it
# would overflow to inf and make the probabilities NaN.
GREEDY_TEMPERATURE = 1e-5
SEED_RANGE = (-(2**63), 2**64)  # what torch.Generator.manual_seed accepts


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


@dataclass(frozen=True)
class SamplingParams:
    """Decoding parameters of one request.

    ``temperature`` 0 (or below ``GREEDY_TEMPERATURE``) is greedy. ``top_k`` 0 or -1 and
    ``top_p`` 1 disable those filters. ``max_tokens`` None means "until eos or
    ``max_model_len``". ``stop`` strings end the generation and are cut from the text;
    ``stop_token_ids`` end it and stay in the token ids (as the eos token does). ``seed``
    gives the request its own random generator, so its samples do not depend on what else
    is in the batch.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: str | list[str] | tuple[str, ...] | None = None
    stop_token_ids: list[int] | tuple[int, ...] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    stop_strings: tuple[str, ...] = field(init=False, repr=False)
    stop_token_id_set: frozenset[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if self.n != 1:
            raise InvalidRequestError("n", f"only n=1 is supported, got {self.n!r}")
        if not _is_number(self.temperature) or self.temperature < 0:
            raise InvalidRequestError(
                "temperature", f"must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_number(self.top_p) or not 0 < self.top_p <= 1:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise InvalidRequestError(
                "top_k", f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}"
            )
        if self.seed is not None and (
            not _is_int(self.seed) or not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]
        ):
            raise InvalidRequestError(
                "seed", f"must be an integer in [-2**63, 2**64) or None, got {self.seed!r}"
            )
        if self.max_tokens is not None and (not _is_int(self.max_tokens) or self.max_tokens < 1):
            raise InvalidRequestError(
                "max_tokens", f"must be a positive integer or None, got {self.max_tokens!r}"
            )
        if not _is_int(self.min_tokens) or self.min_tokens < 0:
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
        object.__setattr__(self, "stop_strings", _stop_strings(self.stop))
        object.__setattr__(self, "stop_token_id_set", _stop_token_ids(self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplingParams:
        """Build from a plain mapping; an unknown key raises ``InvalidRequestError``."""
        known = {"n", "temperature", "top_p", "top_k", "seed", "max_tokens", "min_tokens"}
        known |= {"stop", "stop_token_ids", "ignore_eos", "skip_special_tokens"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequestError(
                unknown[0], f"unknown sampling parameter; known: {sorted(known)}"
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
    if not isinstance(ids, list | tuple) or not all(_is_int(i) and i >= 0 for i in ids):
        raise InvalidRequestError("stop_token_ids", "must be a list of non-negative integers")
    return frozenset(ids)
