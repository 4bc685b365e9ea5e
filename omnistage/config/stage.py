"""A pipeline: an ordered list of stages, each with what every stage has and, under its
kind's key, what only that kind takes (``omnistage.config.options``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, ValidationError, field_validator, model_validator

from omnistage.config import options
from omnistage.config.values import ConfigError, DTypeSetting, Frozen

_DEVICE_RE = re.compile(r"^(cpu|cuda(:\d+)?)$")


class Placement(Frozen):
    """Where a stage runs in a Ray cluster: the resources each of its ranks asks for (the
    ranks of one stage are placed on one node)."""

    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Custom Ray resources per rank (e.g. {node_a: 1} to pin it to a node).",
    )
    num_cpus: float = Field(default=1, ge=0, description="CPUs per rank.")
    num_gpus: float = Field(default=0, ge=0, description="GPUs per rank.")


class StreamChunks(Frozen):
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


def nest_options(data: Any) -> Any:
    """A stage mapping with each kind option given at the top (the flat shape of earlier
    pipeline files, and of Python keywords and server flags) moved under its kind's key;
    an option of another kind only is refused, naming where it belongs."""
    if not isinstance(data, dict):
        return data
    kind = data.get("kind")
    out: dict[str, Any] = {}
    nested: dict[str, Any] = {}
    for key, value in data.items():
        if key in StageConfig.model_fields:
            out[key] = value
            continue
        kinds = options.option_kinds(key)
        if not kinds:
            out[key] = value  # an unknown key: refused, named, by the model
        elif not isinstance(kind, str) or kind not in options.KIND_OPTIONS:
            raise ValueError(
                f"kind: unknown stage kind {kind!r}; known kinds: {list(options.KIND_OPTIONS)}"
            )
        elif kind in kinds:
            name = options.option_name(key)
            if name in nested:
                raise ValueError(f"{key} and {name} are the same setting; give one")
            nested[name] = value
        else:
            where = " or ".join(f"{k}.{options.option_name(key)}" for k in kinds)
            raise ValueError(
                f"{key}: an option of {' and '.join(repr(k) for k in kinds)} stages "
                f"({where}); a {kind!r} stage does not take it"
            )
    if nested and isinstance(kind, str):
        section = out.get(kind)
        if section is None:
            section = {}
        elif isinstance(section, BaseModel):
            section = section.model_dump(exclude_unset=True)
        elif not isinstance(section, dict):
            return out  # the model names the bad section
        twice = sorted(set(section) & set(nested))
        if twice:
            raise ValueError(f"{kind}.{twice[0]} is given twice (at the top and under {kind})")
        out[kind] = {**section, **nested}
    return out


class StageConfig(Frozen):
    """One stage of a pipeline: what every stage has (what it runs, where, which stage feeds
    it, its sleep) and, under the key named as its kind, what only that kind takes
    (``ar``: ``AROptions``, ``diffusion``: ``DiffusionOptions``, ``code2wav``:
    ``Code2WavOptions``, in ``omnistage.config.options``). A kind's options may also be given at the top, the flat shape of
    earlier pipeline files and of Python keywords (``kv_cache_memory=...``)."""

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
    # -- where and how it runs ---------------------------------------------------------------
    device: str = Field(default="cpu", description="'cpu', 'cuda' or 'cuda:N'.")
    dtype: DTypeSetting = Field(
        default="auto",
        description="'auto' (float32 on CPU; on CUDA the checkpoint's dtype, bfloat16 as "
        "float16 where the GPU lacks it), 'float32', 'float16' ('half') or 'bfloat16'.",
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
        description="Ranks the stage's model is split over (Megatron-style; kinds that split: "
        "ar), each a process of its own with its own memory; sleep and wake reach every rank.",
    )
    torch_threads: int | None = Field(
        default=None, gt=0, description="torch threads in the stage process (in each rank's)."
    )
    replicas: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Processes running this stage, each with its own copy of the weights (and "
        "its own tensor_parallel_size ranks); requests are balanced over them and sleep and "
        "wake reach each (replica_ids picks some).",
    )
    replica_devices: list[str] | None = Field(
        default=None,
        description="On CUDA, each replica's device ('cuda:N'; a replica's TP ranks follow it); "
        "unset: replica i starts at the stage's device plus i x tensor_parallel_size.",
    )
    replica_placements: list[Placement] | None = Field(
        default=None,
        description="Ray: each replica's placement, overriding `placement` for that replica "
        "(one per replica, e.g. one per node); unset: every replica asks for `placement`, and "
        "Ray spreads them over the nodes that can hold them.",
    )
    replica_id: int = Field(
        default=0,
        ge=0,
        description="Which replica a stage process is (set by the launcher; 0 for a stage of "
        "one replica).",
    )
    step_threads: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Step-scheduled kinds (diffusion, code2wav): groups of jobs stepped at "
        "once, each on a thread of its own, their results unchanged (several requests at a "
        "time on more cores than one torch thread keeps busy; leave 1 on a GPU).",
    )
    # -- what feeds it -----------------------------------------------------------------------
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
    # -- sleep -------------------------------------------------------------------------------
    enable_sleep_mode: bool = Field(default=False, description="Allow sleep/wake of this stage.")
    drain_timeout_s: float = Field(
        default=30.0, gt=0, description="Longest wait for mode 'wait' drains."
    )
    idle_sleep_s: float | None = Field(
        default=None, gt=0, description="Put the stage to sleep after this many idle seconds."
    )
    idle_sleep_level: Literal[1, 2] = Field(default=1, description="Level of an idle sleep.")
    # -- each kind's own ---------------------------------------------------------------------
    ar: options.AROptions = Field(
        default_factory=options.AROptions, description="An AR stage's options."
    )
    diffusion: options.DiffusionOptions = Field(
        default_factory=options.DiffusionOptions, description="A diffusion stage's options."
    )
    code2wav: options.Code2WavOptions = Field(
        default_factory=options.Code2WavOptions, description="A code2wav stage's options."
    )

    @model_validator(mode="before")
    @classmethod
    def _flat_options(cls, data: Any) -> Any:
        return nest_options(data)

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
        for kind, section in options.KIND_OPTIONS.items():
            if kind != self.kind and getattr(self, kind) != section():
                raise ValueError(f"{kind}: a {self.kind!r} stage takes no {kind!r} options")
        self._check_replicas()
        if self.ar.gpu_memory_utilization is not None and not self.device.startswith("cuda"):
            raise ValueError(
                "ar.gpu_memory_utilization applies to CUDA stages; size the KV cache of a "
                f"{self.device!r} stage with ar.kv_cache_memory (bytes)"
            )
        return self

    def _check_replicas(self) -> None:
        if self.replica_id >= self.replicas:
            raise ValueError(f"replica_id {self.replica_id} is not below replicas {self.replicas}")
        placements = self.replica_placements
        if placements is not None and len(placements) != self.replicas:
            raise ValueError(
                f"replica_placements: {len(placements)} placements for {self.replicas} replicas"
            )
        devices = self.replica_devices
        if devices is None:
            return
        if not self.device.startswith("cuda"):
            raise ValueError("replica_devices: replicas are placed on CUDA devices only")
        if len(devices) != self.replicas:
            raise ValueError(
                f"replica_devices: {len(devices)} devices for {self.replicas} replicas"
            )
        for device in devices:
            if not device.startswith("cuda") or not _DEVICE_RE.match(device):
                raise ValueError(f"replica_devices: {device!r} is not 'cuda' or 'cuda:N'")
        share = self.ar.gpu_memory_utilization
        for device in set(devices):
            count = sum(d == device for d in devices)
            if count > 1 and (share is None or count * share > 1.0):
                said = "unset (each takes the whole)" if share is None else f"{share:g} each"
                raise ValueError(
                    f"replica_devices: {count} replicas on {device} with "
                    f"ar.gpu_memory_utilization {said} add up past 1"
                )

    def replica_config(self, replica_id: int) -> StageConfig:
        """The config of replica ``replica_id``'s process: this one, on its own device, with
        its own Ray placement (``replica_placements``). A replica whose placement asks Ray for
        GPUs keeps the stage's device: Ray hands each replica its own GPUs, which it sees from
        ``cuda:0`` on."""
        update: dict[str, Any] = {"replica_id": replica_id}
        placement = self.placement
        if self.replica_placements is not None:
            placement = update["placement"] = self.replica_placements[replica_id]
        ray_gpus = placement is not None and placement.num_gpus > 0
        if self.replica_devices is not None:
            update["device"] = self.replica_devices[replica_id]
        elif self.device.startswith("cuda") and replica_id and not ray_gpus:
            base = int(self.device.partition(":")[2] or 0)
            update["device"] = f"cuda:{base + replica_id * self.tensor_parallel_size}"
        return self.model_copy(update=update)

    @property
    def display_name(self) -> str:
        return self.name or self.kind


class PipelineConfig(Frozen):
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


_OFFLINE_FIXED_FIELDS = frozenset({"stage_id", "kind", "model", *options.KIND_OPTIONS})


def offline_stage_config(caller: str, kind: str, model: str, **fields: Any) -> StageConfig:
    """The one-stage config of an offline API object (``LLM``, ``Diffusion``).

    ``fields`` are ``StageConfig`` fields and the options of ``kind`` by their own names
    (``max_model_len=...``); an unknown keyword raises ``TypeError`` naming it (as a Python
    call would), a bad value ``ConfigError`` naming the key.
    """
    allowed = (set(StageConfig.model_fields) - _OFFLINE_FIXED_FIELDS) | set(
        options.KIND_OPTIONS[kind].model_fields
    )
    unknown = sorted(set(fields) - allowed - set(options.OLD_OPTION_NAMES))
    twice = options.same_setting_twice(fields)
    if twice:
        raise TypeError(f"{caller}() got {twice[0]} and {twice[1]} (the same setting); give one")
    if unknown:
        raise TypeError(
            f"{caller}() got unexpected keyword arguments {unknown}; other StageConfig fields "
            f"are allowed: {sorted(allowed)}"
        )
    try:
        return StageConfig(stage_id=0, kind=kind, model=str(model), **fields)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc, f"{caller}()")) from None
