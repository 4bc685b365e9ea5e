"""The bounds a weight sync's values keep, checked on both sides (a trainer fails early, the
stage refuses with a 400 naming the field). No torch: the engine client checks a
``weight_version`` when it makes the control operation, in a process that may not have
imported torch."""

from __future__ import annotations

import re

from omnistage.errors import InvalidRequestError

MAX_TIMEOUT_S = 600.0  # a transfer's timeout_s: in (0, MAX_TIMEOUT_S]
DEFAULT_TIMEOUT_S = 60.0
MAX_VERSION_CHARS = 128
VERSION_CHARS = "A-Za-z0-9._:+-"
_VERSION = re.compile(f"[{VERSION_CHARS}]+")


def check_weight_version(value: object) -> str:
    """``value`` (a str or int) as the version string; a version shows in every reply
    (``system_fingerprint``), so it is short and plain (``InvalidRequestError`` otherwise)."""
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise InvalidRequestError("weight_version", "must be a string or an integer")
    if isinstance(value, int) and abs(value) >= 10**MAX_VERSION_CHARS:  # before str() of it
        raise InvalidRequestError("weight_version", f"has over {MAX_VERSION_CHARS} digits")
    version = str(value)
    if len(version) > MAX_VERSION_CHARS:
        raise InvalidRequestError(
            "weight_version", f"has {len(version)} characters; at most {MAX_VERSION_CHARS}"
        )
    if not _VERSION.fullmatch(version):
        raise InvalidRequestError(
            "weight_version", f"must be 1 to {MAX_VERSION_CHARS} of [{VERSION_CHARS}]"
        )
    return version


def check_timeout(value: object, field: str = "init_info.timeout_s") -> float:
    """A transfer timeout in seconds, in (0, MAX_TIMEOUT_S]: a stalled trainer holds a
    stage's transfer (never its serving) at most that long."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidRequestError(field, f"must be a number of seconds, got {value!r:.40}")
    if not 0 < value <= MAX_TIMEOUT_S:
        raise InvalidRequestError(field, f"must be in (0, {MAX_TIMEOUT_S:g}] seconds, got {value}")
    return float(value)
