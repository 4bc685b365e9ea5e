"""Each stage kind's own options: what only an AR, a diffusion or a code2wav stage takes.
A ``StageConfig`` holds them under a field named as the kind (``ar:``, ``diffusion:``,
``code2wav:`` in a pipeline file); ``KIND_OPTIONS`` is the map (``stage/kinds.py`` holds the
same kinds; a test keeps them equal)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from omnistage.config.values import AttentionBackendName, ByteCount, Frozen


class AROptions(Frozen):
    """What only an autoregressive stage (``kind: ar``) takes: its KV cache, scheduler,
    attention and per-request bounds. A pipeline file gives them under ``ar:``."""

    kv_cache_memory: ByteCount | None = Field(
        default=None,
        gt=0,
        description="KV cache size in bytes, on any device (vLLM's name; units such as "
        "'512MiB' or '2GB' accepted; kv_cache_bytes, its old name, still loads).",
    )
    kv_cache_memory_fraction: float = Field(
        default=0.1,
        gt=0,
        le=0.95,
        description="KV cache as a fraction of free memory, if no bytes given.",
    )
    gpu_memory_utilization: float | None = Field(
        default=None,
        gt=0,
        le=1,
        description="CUDA: share of the device's total memory this stage may fill (what is "
        "already in use on the device, its weights included, counts against it); the KV "
        "cache gets the rest. Replaces kv_cache_memory_fraction.",
    )
    block_size: int = Field(default=16, gt=0, le=1024, description="Tokens per KV cache block.")
    attention_backend: AttentionBackendName | None = Field(
        default=None,
        description="The attention backend (default: torch_sdpa on CPU, batch-invariant; "
        "torch_sdpa_padded on CUDA, whose decode steps are captured in CUDA graphs).",
    )
    enforce_eager: bool = Field(
        default=False,
        description="On CUDA: never capture decode steps in CUDA graphs (vLLM's "
        "enforce_eager); every step runs eagerly.",
    )
    max_num_seqs: int = Field(default=32, gt=0, description="Most sequences decoded at once.")
    max_num_batched_tokens: int = Field(
        default=2048, gt=0, description="Most tokens in one engine step."
    )
    max_model_len: int | None = Field(
        default=None,
        gt=0,
        description="Longest prompt + output, in tokens (default: the checkpoint's "
        "max_position_embeddings; never above it).",
    )
    enable_prefix_caching: bool = Field(
        default=True, description="Reuse the KV blocks of prompts that start alike."
    )
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = Field(
        default="raw_logprobs",
        description="Logprobs of the model's raw distribution, or of the processed one "
        "tokens are drawn from (temperature, top-k, top-p, bans applied).",
    )
    encoder_cache_mb: int = Field(
        default=256,
        ge=0,
        description="MiB of encoder outputs (audio, images, video) kept by the media's "
        "content, so the same medium sent again is not encoded again; 0 turns it off.",
    )
    max_answer_logprobs: int = Field(
        default=1_000_000,
        gt=0,
        description="Most logprob entries one request's answer may carry, n x (prompt "
        "tokens x (prompt_logprobs + 1) + max_tokens x (logprobs + 1)); more is refused up "
        "front (400) instead of filling the server's memory with one reply.",
    )
    max_request_tokens: int | None = Field(
        default=None,
        gt=0,
        description="Most tokens one request may ask the stage to hold, n x (prompt "
        "tokens + max_tokens, or the rest of the context without it); more is refused up "
        "front (400). None: bounded by n and max_model_len only.",
    )
    override_generation_config: dict[str, Any] = Field(
        default_factory=dict,
        description="Default sampling parameters of this stage's requests over the "
        "model's, under each request's own (vLLM's --override-generation-config), e.g. "
        "{max_tokens: 256} to bound a speech stage's codes.",
    )

    @model_validator(mode="after")
    def _one_kv_sizing(self) -> AROptions:
        if self.gpu_memory_utilization is not None and self.kv_cache_memory is not None:
            raise ValueError("give gpu_memory_utilization or kv_cache_memory, not both")
        return self


class DiffusionOptions(Frozen):
    """What only a diffusion stage (``kind: diffusion``) takes: its batches and per-request
    bounds. A pipeline file gives them under ``diffusion:``."""

    max_batch_size: int = Field(default=4, gt=0, description="Most images denoised at once.")
    batch_wait_ms: float = Field(
        default=10.0,
        ge=0,
        le=10_000,
        description="How long a request waits for others arriving with it to share its "
        "batch, while the batch has room (0: it starts at once).",
    )
    max_active_batches: int = Field(
        default=2,
        gt=0,
        le=16,
        description="Batches denoised at once, taking turns step by step.",
    )
    max_image_pixels: int | None = Field(
        default=None,
        gt=0,
        description="Largest image (width x height) a request may ask for (default: 512x512 "
        "on CPU, 2048x2048 on CUDA).",
    )
    max_inference_steps: int = Field(
        default=200, gt=0, le=1000, description="Most denoising steps per request."
    )


class Code2WavOptions(Frozen):
    """What only a speech-code vocoder stage (``kind: code2wav``) takes. A pipeline file gives
    them under ``code2wav:``."""

    max_num_seqs: int = Field(default=32, gt=0, description="Most utterances spoken at once.")


# Each kind's own options: the StageConfig field (named as the kind) that holds them.
KIND_OPTIONS: dict[str, type[Frozen]] = {
    "ar": AROptions,
    "diffusion": DiffusionOptions,
    "code2wav": Code2WavOptions,
}
# Old names of options that still load.
OLD_OPTION_NAMES = {"kv_cache_bytes": "kv_cache_memory"}


def option_name(key: str) -> str:
    """A setting's name (an old name of a kind option: its new one)."""
    return OLD_OPTION_NAMES.get(key, key)


def same_setting_twice(keys: Any) -> tuple[str, str] | None:
    """An option given under both its names (``kv_cache_memory`` and ``kv_cache_bytes``)."""
    for old, new in OLD_OPTION_NAMES.items():
        if old in keys and new in keys:
            return new, old
    return None


def option_kinds(key: str) -> list[str]:
    """The kinds whose options include ``key`` (a flat key, old names accepted)."""
    key = option_name(key)
    return [kind for kind, options in KIND_OPTIONS.items() if key in options.model_fields]
