"""vLLM's ``LLM`` arguments, as RL frameworks pass them to ``omnistage.LLM``: those that mean
something here are taken, the others refused with a ``TypeError`` saying why — never a bare
"unexpected keyword argument" for an argument vLLM documents. The rest of vLLM's engine
arguments are ``StageConfig`` fields of the same name (``enforce_eager`` among them)."""

from __future__ import annotations

from typing import Any

# vLLM's ``LLM`` arguments that mean something here (taken) and those that do not (refused,
# saying why). The rest of vLLM's engine arguments are StageConfig fields of the same name.
_VLLM_TAKEN = {
    "trust_remote_code": "omnistage runs its own model code, never a checkpoint's",
    "disable_log_stats": "the offline LLM logs no statistics",
}
_VLLM_REFUSED = {
    "quantization": "quantized checkpoints are not served yet",
    "load_format": "weights load from the checkpoint's safetensors files only",
    "tokenizer": "the tokenizer is the checkpoint's own (give the same folder or leave it out)",
    "revision": "checkpoints are local folders; nothing is downloaded",
    "download_dir": "checkpoints are local folders; nothing is downloaded",
    "swap_space": "a preempted sequence recomputes its KV cache; nothing is swapped to the host",
    "cpu_offload_gb": "weights stay on the stage's device (sleep level 1 moves them to the host)",
    "distributed_executor_backend": "a stage's ranks are its own processes "
    "(tensor_parallel_size); Ray places whole stages (the server's --distributed-executor-backend)",
    "enable_lora": "LoRA adapters are not served yet",
    "max_lora_rank": "LoRA adapters are not served yet",
    "speculative_config": "speculative decoding is not implemented",
    "kv_cache_dtype": "the KV cache takes the model's dtype",
    "enable_chunked_prefill": "a prompt is prefilled whole (max_num_batched_tokens bounds a step)",
    "pipeline_parallel_size": "a stage runs on one rank or tensor_parallel_size ranks",
}
_VLLM_CALL_REFUSED = {
    "lora_request": "LoRA adapters are not served yet",
    "priority": "requests are scheduled first come, first served (with a fair share of slots)",
    "prompt_adapter_request": "prompt adapters are not implemented",
    "guided_options_request": "structured outputs are not implemented",
}


def vllm_arguments(model: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` with vLLM's ``LLM`` arguments taken or refused (``TypeError`` naming the
    argument and why); ``enforce_eager`` is the stage's own field."""
    out = dict(kwargs)
    for name in _VLLM_TAKEN:
        out.pop(name, None)
    if out.get("tokenizer") in (None, model, str(model)):
        out.pop("tokenizer", None)
    if out.get("load_format") in ("auto", "safetensors"):
        out.pop("load_format", None)
    for name, why in _VLLM_REFUSED.items():
        if name in out and out[name] not in (None, False):
            raise TypeError(f"LLM() does not take {name}={out[name]!r}: {why}")
        out.pop(name, None)
    return out


def refuse_call_arguments(method: str, given: dict[str, Any]) -> None:
    for name, value in given.items():
        why = _VLLM_CALL_REFUSED.get(name)
        if why is None:
            raise TypeError(f"LLM.{method}() got an unexpected keyword argument {name!r}")
        if value is not None:
            raise TypeError(f"LLM.{method}() does not take {name}: {why}")
