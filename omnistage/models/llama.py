"""Llama (``LlamaForCausalLM``): ``attention_bias`` on every attention projection, optional
``mlp_bias``, rotary scaling of the llama3 kind."""

from __future__ import annotations

from typing import Any

from omnistage.models.family import DecoderFamily


def layout(raw: dict[str, Any]) -> dict[str, Any]:
    bias = bool(raw.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "mlp_bias": bool(raw.get("mlp_bias", False))}


FAMILY = DecoderFamily("llama", layout)
