"""Typed, validated configuration: a pipeline is an ordered list of stages.

Configs reject unknown keys and bad values with the offending key named, and are frozen:
values resolved at start-up (KV blocks, thread counts) are returned by the code that resolves
them, never written back here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

DType = Literal["auto", "float32", "float16", "bfloat16"]
# The attention backends (``omnistage.models.attention``; named here, where no torch loads).
AttentionBackendName = Literal["torch_sdpa", "torch_sdpa_padded"]
# vLLM's spellings of the same dtypes.
DTYPE_ALIASES = {"half": "float16", "float": "float32", "fp16": "float16", "bf16": "bfloat16"}
_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


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


class _Frozen(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Placement(_Frozen):
    """Where a stage runs in a Ray cluster: the resources each of its ranks asks for (the
    ranks of one stage are placed on one node)."""

    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per rank (e.g. {node_a: 1} to pin it to a node).",
    )
    num_cpus: float = Field(default=1, ge=0, description="CPUs per rank.")
    num_gpus: float = Field(default=0, ge=0, description="GPUs per rank.")


class StreamChunks(_Frozen):
    """How a stage with ``stream: true`` takes its input while the stage before still
    produces it, in that stage's tokens (a talker's codes): the first chunk is small, for a
    fast first answer; each chunk is computed with context on both sides."""

    first_chunk: int = Field(default=12, ge=1, le=4096, description="Tokens in the first chunk.")
    chunk: int = Field(default=36, ge=1, le=4096, description="Tokens in each later chunk.")
    left_context: int = Field(
        default=24, ge=0, le=4096, description="Tokens before a chunk computed with it."
    )
    right_context: int = Field(
        default=12,
        ge=0,
        le=4096,
        description="Tokens after a chunk computed with it (a chunk waits for them).",
    )


class StageConfig(_Frozen):
    stage_id: int = Field(ge=0, description="Position of the stage in the pipeline (0-based).")
    kind: str = Field(
        pattern=r"^[a-z][a-z0-9_]*$",
        description="The stage kind (see omnistage.stage.kinds): an autoregressive LLM, an "
        "image diffusion pipeline, a speech-code vocoder.",
    )
    model: str = Field(
        min_length=1, description="Checkpoint folder (HF layout or diffusers layout)."
    )
    model_stage: str | None = Field(
        default=None,
        description="The part of a multi-part checkpoint this stage runs (its model family "
        "names them, e.g. 'thinker', 'talker', 'code2wav').",
    )
    preset: str | None = Field(
        default=None, description="Built-in tiny preset to build into `model` when it is missing."
    )
    name: str | None = Field(default=None, description="Display name; defaults to the kind.")
    device: str = Field(default="cpu", description="'cpu', 'cuda' or 'cuda:N'.")
    dtype: DTypeSetting = Field(
        default="auto",
        description="'auto' (float32 on CPU; on CUDA the checkpoint's dtype, bfloat16 as "
        "float16 where the GPU lacks it), 'float32', 'float16' ('half') or 'bfloat16'.",
    )
    enable_sleep_mode: bool = Field(default=False, description="Allow sleep/wake of this stage.")
    kv_cache_bytes: ByteCount | None = Field(
        default=None,
        gt=0,
        validation_alias=AliasChoices("kv_cache_bytes", "kv_cache_memory"),
        description="AR: KV cache size in bytes, on any device (also spelled kv_cache_memory, "
        "vLLM's name; units such as '512MiB' or '2GB' accepted).",
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
        description="AR: the attention backend (default: torch_sdpa on CPU, batch-invariant; "
        "torch_sdpa_padded on CUDA, whose decode steps are captured in CUDA graphs).",
    )
    enforce_eager: bool = Field(
        default=False,
        description="AR on CUDA: never capture decode steps in CUDA graphs (vLLM's "
        "enforce_eager); every step runs eagerly.",
    )
    max_num_seqs: int = Field(
        default=32,
        gt=0,
        description="Most sequences decoded at once (code2wav: most utterances spoken at once).",
    )
    enable_prefix_caching: bool = Field(
        default=True, description="AR: reuse the KV blocks of prompts that start alike."
    )
    logprobs_mode: Literal["raw_logprobs", "processed_logprobs"] = Field(
        default="raw_logprobs",
        description="AR: logprobs of the model's raw distribution, or of the processed one "
        "tokens are drawn from (temperature, top-k, top-p, bans applied).",
    )
    encoder_cache_mb: int = Field(
        default=256,
        ge=0,
        description="AR: MiB of encoder outputs (audio, images, video) kept by the media's "
        "content, so the same medium sent again is not encoded again; 0 turns it off.",
    )
    max_answer_logprobs: int = Field(
        default=1_000_000,
        gt=0,
        description="AR: most logprob entries one request's answer may carry, n x (prompt "
        "tokens x (prompt_logprobs + 1) + max_tokens x (logprobs + 1)); more is refused up "
        "front (400) instead of filling the server's memory with one reply.",
    )
    max_request_tokens: int | None = Field(
        default=None,
        gt=0,
        description="AR: most tokens one request may ask the stage to hold, n x (prompt "
        "tokens + max_tokens, or the rest of the context without it); more is refused up "
        "front (400). None: bounded by n and max_model_len only.",
    )
    override_generation_config: dict[str, Any] = Field(
        default_factory=dict,
        description="AR: default sampling parameters of this stage's requests over the "
        "model's, under each request's own (vLLM's --override-generation-config), e.g. "
        "{max_tokens: 256} to bound a speech stage's codes.",
    )
    max_num_batched_tokens: int = Field(
        default=2048, gt=0, description="AR: most tokens in one engine step."
    )
    max_model_len: int | None = Field(
        default=None,
        gt=0,
        description="AR: longest prompt + output, in tokens (default: the checkpoint's "
        "max_position_embeddings; never above it).",
    )
    max_batch_size: int = Field(
        default=4, gt=0, description="Diffusion: most images denoised at once."
    )
    batch_wait_ms: float = Field(
        default=10.0,
        ge=0,
        le=10_000,
        description="Diffusion: how long a request waits for others arriving with it to share "
        "its batch, while the batch has room (0: it starts at once).",
    )
    max_active_batches: int = Field(
        default=2,
        gt=0,
        le=16,
        description="Diffusion: batches denoised at once, taking turns step by step.",
    )
    max_image_pixels: int | None = Field(
        default=None,
        gt=0,
        description="Diffusion: largest image (width x height) a request may ask for "
        "(default: 512x512 on CPU, 2048x2048 on CUDA).",
    )
    max_inference_steps: int = Field(
        default=200, gt=0, le=1000, description="Diffusion: most denoising steps per request."
    )
    input_from: int | None = Field(
        default=None, ge=0, description="Stage whose final output feeds this stage."
    )
    input_processor: str | None = Field(
        default=None, description="Named function turning that output into this stage's input."
    )
    stream: bool = Field(
        default=False,
        description="Take input_from's output while it is produced, chunk by chunk "
        "(stream_chunks), instead of whole when that stage finishes.",
    )
    stream_chunks: StreamChunks = Field(
        default_factory=StreamChunks, description="Chunk sizes of a streamed input."
    )
    torch_threads: int | None = Field(
        default=None, gt=0, description="torch threads in the stage process (in each rank's)."
    )
    step_threads: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Step-scheduled kinds (diffusion, code2wav): groups of jobs stepped at "
        "once, each on a thread of its own, their results unchanged (several requests at a "
        "time on more cores than one torch thread keeps busy; leave 1 on a GPU).",
    )
    placement: Placement | None = Field(
        default=None,
        description="Run the stage as a Ray actor with these resources (the pipeline then "
        "runs on Ray: RAY_ADDRESS, a running cluster, or a local one).",
    )
    tensor_parallel_size: int = Field(
        default=1,
        ge=1,
        le=64,
        description="AR: ranks the stage's model is split over (Megatron-style), each a "
        "process of its own with its own memory; sleep and wake reach every rank.",
    )
    drain_timeout_s: float = Field(
        default=30.0, gt=0, description="Longest wait for mode 'wait' drains."
    )
    idle_sleep_s: float | None = Field(
        default=None, gt=0, description="Put the stage to sleep after this many idle seconds."
    )
    idle_sleep_level: Literal[1, 2] = Field(default=1, description="Level of an idle sleep.")

    @field_validator("device")
    @classmethod
    def _check_device(cls, v: str) -> str:
        if not _DEVICE_RE.match(v):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {v!r}")
        return v

    @model_validator(mode="after")
    def _check_input(self) -> StageConfig:
        if self.input_from is not None and self.input_from >= self.stage_id:
            raise ValueError(
                f"input_from must name an earlier stage (< {self.stage_id}), got {self.input_from}"
            )
        if self.input_from is not None and self.input_processor is None:
            raise ValueError("input_processor is required when input_from is set")
        if self.stream and self.input_from is None:
            raise ValueError("stream needs input_from: the stage whose output it streams")
        if self.idle_sleep_s is not None and not self.enable_sleep_mode:
            raise ValueError("idle_sleep_s needs enable_sleep_mode: true")
        if self.gpu_memory_utilization is not None:
            if not self.device.startswith("cuda"):
                raise ValueError(
                    "gpu_memory_utilization applies to CUDA stages; size the KV cache of a "
                    f"{self.device!r} stage with kv_cache_memory (bytes)"
                )
            if self.kv_cache_bytes is not None:
                raise ValueError("give gpu_memory_utilization or kv_cache_memory, not both")
        return self

    @property
    def display_name(self) -> str:
        return self.name or self.kind


class PipelineConfig(_Frozen):
    name: str = Field(default="pipeline", min_length=1)
    stages: list[StageConfig] = Field(min_length=1)

    @model_validator(mode="after")
    def _check_stage_ids(self) -> PipelineConfig:
        ids = [s.stage_id for s in self.stages]
        if ids != list(range(len(ids))):
            raise ValueError(f"stage_id values must be 0..{len(ids) - 1} in order, got {ids}")
        return self

    @property
    def num_stages(self) -> int:
        return len(self.stages)


def _format_error(exc: ValidationError, source: str) -> str:
    lines = []
    for err in exc.errors():
        key = ".".join(str(p) for p in err["loc"]) or "<root>"
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"{key}: {msg}")
    return f"invalid config {source}: " + "; ".join(lines)


def parse_pipeline_config(data: Any, source: str = "<dict>") -> PipelineConfig:
    """Validate a mapping as a ``PipelineConfig``; errors name each offending key."""
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, source)) from None


def load_pipeline_config(path: str | Path) -> PipelineConfig:
    """Read and validate a pipeline config from YAML."""
    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"cannot read config {p}: {exc}") from exc
    return parse_pipeline_config(data, source=str(p))


_OFFLINE_FIXED_FIELDS = frozenset(
    {"stage_id", "kind", "model", "device", "dtype", "enable_sleep_mode"}
)


def offline_stage_config(caller: str, kind: str, model: str, **fields: Any) -> StageConfig:
    """The one-stage config of an offline API object (``LLM``, ``Diffusion``).

    ``fields`` are ``device``, ``dtype``, ``enable_sleep_mode`` and any other ``StageConfig``
    field; an unknown keyword raises ``TypeError`` naming it (as a Python call would), a bad
    value ``ConfigError`` naming the key.
    """
    allowed = (set(StageConfig.model_fields) - _OFFLINE_FIXED_FIELDS) | {
        "device",
        "dtype",
        "enable_sleep_mode",
    }
    unknown = sorted(set(fields) - allowed)
    if unknown:
        raise TypeError(
            f"{caller}() got unexpected keyword arguments {unknown}; other StageConfig fields "
            f"are allowed: {sorted(allowed)}"
        )
    try:
        return StageConfig(stage_id=0, kind=kind, model=str(model), **fields)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, f"{caller}()")) from None
