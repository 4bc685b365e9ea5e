"""Qwen3 (``Qwen3ForCausalLM``): per-head RMSNorm of queries and keys, an explicit
``head_dim``, ``attention_bias`` on every attention projection."""

from __future__ import annotations

from typing import Any

from omnistage.models.family import DecoderFamily


def layout(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True}


FAMILY = DecoderFamily("qwen3", layout)
