"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3's attention, and in every
``decoder_sparse_step``-th layer (but ``mlp_only_layers``) ``num_experts`` experts of
``moe_intermediate_size`` features, ``num_experts_per_tok`` per token."""

from __future__ import annotations

from typing import Any

from omnistage.errors import CheckpointError
from omnistage.models.family import DecoderFamily
from omnistage.models.qwen3 import layout as qwen3_layout


def layout(raw: dict[str, Any]) -> dict[str, Any]:
    try:
        experts = {
            # transformers 5 writes num_local_experts; the published checkpoints num_experts
            "num_experts": int(raw.get("num_experts", raw.get("num_local_experts"))),  # type: ignore[arg-type]
            "num_experts_per_tok": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": int(raw["moe_intermediate_size"]),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", False)),
            "decoder_sparse_step": int(raw.get("decoder_sparse_step", 1)),
            "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        }
    except (KeyError, TypeError, ValueError) as exc:  # a missing key or a None
        raise CheckpointError(f"config.json: the experts are not described: {exc!r}") from None
    return {**qwen3_layout(raw), **experts}


FAMILY = DecoderFamily("qwen3_moe", layout)
