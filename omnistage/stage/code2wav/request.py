"""A code2wav request inside the stage, and the checks both sides run on its fields.

Light (no model code): the API process's preparer and the stage's engine check codes and
voices with the same functions, against the ``Code2WavLimits`` the stage reported.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from omnistage.errors import InvalidRequestError
from omnistage.stage.code2wav.params import Code2WavLimits, Code2WavParams


@dataclass(eq=False)
class Code2WavRequest:
    """Speech-codec tokens to speak (without the talker's end token) and how."""

    request_id: str
    codes: list[int]
    params: Code2WavParams = field(default_factory=Code2WavParams)
    arrival_time: float = field(default_factory=time.monotonic)
    queue_time_s: float | None = None  # set when its job starts
    streamed: bool = False  # its codes arrive while the stage before still speaks
    input_ended: bool = True  # a streamed request's last codes are in


def check_codes(
    codes: Any, limits: Code2WavLimits, name: str = "codes", *, before: int = 0
) -> list[int]:
    """``codes`` as a list of ints, or ``InvalidRequestError`` naming ``name``: a non-empty
    list of at most ``max_codes`` integers in ``[0, codebook_size)``, whole frames of
    ``codes_per_frame`` (``before``: codes of the same utterance already taken; a streamed
    piece may then be empty)."""
    if not isinstance(codes, list | tuple) or not all(
        isinstance(c, int) and not isinstance(c, bool) for c in codes
    ):
        raise InvalidRequestError(name, "must be a list of integers (speech-codec tokens)")
    if not codes and not before:
        raise InvalidRequestError(name, "must not be empty")
    if before + len(codes) > limits.max_codes:
        raise InvalidRequestError(
            name,
            f"{before + len(codes)} codes exceed this stage's limit of {limits.max_codes}",
        )
    if len(codes) % limits.codes_per_frame:
        raise InvalidRequestError(
            name,
            f"{len(codes)} codes are not whole frames of {limits.codes_per_frame} codes "
            "(one per codebook, frame after frame)",
        )
    bad = next((c for c in codes if not 0 <= c < limits.codebook_size), None)
    if bad is not None:
        raise InvalidRequestError(
            name, f"code {bad} is outside the codebook [0, {limits.codebook_size})"
        )
    return list(codes)


def check_voice(voice: str | None, limits: Code2WavLimits, name: str = "voice") -> str:
    """The voice to speak with (None: the default one), or ``InvalidRequestError``."""
    if voice is None:
        return limits.default_voice
    if voice not in limits.voices:
        raise InvalidRequestError(name, f"unknown voice {voice!r}; this stage has {limits.voices}")
    return voice


def validate_request(request: Code2WavRequest, limits: Code2WavLimits) -> None:
    """Raise ``InvalidRequestError`` naming the first invalid field of ``request``."""
    if not isinstance(request.request_id, str) or not request.request_id:
        raise InvalidRequestError("request_id", "must be a non-empty string")
    if not isinstance(request.params, Code2WavParams):
        raise InvalidRequestError("params", "must be Code2WavParams")
    check_voice(request.params.voice, limits)
    if not (request.streamed and not request.codes):  # a stream's codes come later
        check_codes(request.codes, limits)
