"""How requests reach the talker: its sampling parameters come from a request's
``talker_params`` over transformers' talker defaults, and it always stops on the codec end
and pad codes."""

from __future__ import annotations

from typing import Any

from omnistage.models.qwen2_5_omni.config import TalkerTokens, read_config

PARAMS_FIELD = "talker_params"
# transformers' Qwen2_5OmniForConditionalGeneration.generate talker defaults.
TALKER_DEFAULTS: dict[str, Any] = {
    "temperature": 0.9,
    "top_k": 40,
    "top_p": 0.8,
    "repetition_penalty": 1.05,
    "max_tokens": 4096,
}


def request_setup(folder: str) -> dict[str, Any]:
    """What the talker stage reports for requests (``ARStageInfo``'s fields)."""
    tokens = TalkerTokens.from_config(read_config(folder) or {})
    return {
        "params_field": PARAMS_FIELD,
        "param_defaults": dict(TALKER_DEFAULTS),
        "stop_token_ids": [tokens.codec_pad, tokens.codec_eos],
    }
