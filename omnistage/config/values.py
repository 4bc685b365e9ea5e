"""Values every config takes: byte counts with units, dtypes by vLLM's names too, the
attention backends' names; the frozen base and the error that names the key."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict

DType = Literal["auto", "float32", "float16", "bfloat16"]
# The attention backends (``omnistage.models.attention``; named here, where no torch loads).
AttentionBackendName = Literal["torch_sdpa", "torch_sdpa_padded"]
# vLLM's spellings of the same dtypes.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp16": "float16", "bf16": "bfloat16"}


_BYTE_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "ki": 2**10,
    "kib": 2**10,
    "mi": 2**20,
    "mib": 2**20,
    "gi": 2**30,
    "gib": 2**30,
    "ti": 2**40,
    "tib": 2**40,
}
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str) -> int:
    """``"4096"``, ``"512MiB"``, ``"2GB"``, ``"1.5g"`` -> bytes (``ValueError`` otherwise)."""
    match = _BYTES_RE.match(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _BYTE_UNITS:
        raise ValueError(
            f"must be a byte count such as 1073741824, '512MiB' or '2GB', got {text!r}"
        )
    return int(float(match.group(1)) * _BYTE_UNITS[unit])


def _dtype_alias(value: Any) -> Any:
    return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value


def _byte_count(value: Any) -> Any:
    return parse_bytes(value) if isinstance(value, str) else value


# A dtype setting (vLLM's aliases accepted) and a byte count (units accepted), for every config
# that takes one.
DTypeSetting = Annotated[DType, BeforeValidator(_dtype_alias)]
ByteCount = Annotated[int, BeforeValidator(_byte_count)]


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the key."""


class Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
