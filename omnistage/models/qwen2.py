"""Qwen2 and Qwen2.5 (``Qwen2ForCausalLM``): q/k/v projections always carry a bias, the output
projection never."""

from __future__ import annotations

from typing import Any

from omnistage.models.family import DecoderFamily


def layout(raw: dict[str, Any]) -> dict[str, Any]:
    return {"qkv_bias": True, "o_bias": False, "mlp_bias": bool(raw.get("mlp_bias", False))}


FAMILY = DecoderFamily("qwen2", layout)
