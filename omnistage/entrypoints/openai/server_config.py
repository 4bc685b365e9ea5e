"""The server's typed configuration; ``omnistage serve`` builds its flags from it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    field_validator,
    model_validator,
)

from omnistage.config import (
    KIND_OPTIONS,
    AttentionBackendName,
    ByteCount,
    DTypeSetting,
    PipelineConfig,
    StageConfig,
    option_kinds,
)
from omnistage.entrypoints.openai.media_settings import MediaSettings
from omnistage.pipelines import builtin_pipelines


def _names(value: Any) -> Any:
    """``--served-model-name a b`` (vLLM's shape), or one name as a string (None: none)."""
    if value is None:
        return []
    return [value] if isinstance(value, str) else value


# Server flags that set a stage setting on every stage that takes it (a kind's option, the
# stages of that kind), named as the setting.
STAGE_FLAGS = (
    "device",
    "dtype",
    "idle_sleep_s",
    "max_image_pixels",
    "max_model_len",
    "max_num_seqs",
    "tensor_parallel_size",
    "max_num_batched_tokens",
    "gpu_memory_utilization",
    "kv_cache_memory",
    "enable_prefix_caching",
    "max_answer_logprobs",
    "max_request_tokens",
    "attention_backend",
    "enforce_eager",
)
_BOUNDS = ("gt", "ge", "lt", "le")


def stage_flag(flag: str, *, note: str = "") -> Any:
    """The field of a server flag that sets its stage setting on every stage that takes it:
    the setting's bounds and description (with ``note``, and the kinds whose option it is),
    default None (each stage keeps its own)."""
    kinds = option_kinds(flag)
    field = (
        StageConfig.model_fields[flag] if not kinds else KIND_OPTIONS[kinds[0]].model_fields[flag]
    )
    bounds = {k: getattr(m, k) for m in field.metadata for k in _BOUNDS if hasattr(m, k)}
    stages = "every stage" if not kinds else f"every {' and '.join(kinds)} stage"
    said = f"{field.description}{note} Set on {stages} (unset: each stage keeps its own)."
    return Field(default=None, description=said, **bounds)


class ServerConfig(MediaSettings):
    model_config = ConfigDict(extra="forbid", frozen=True)

    pipeline: str | None = Field(
        default=None,
        description="Built-in pipeline to serve (default tiny-omni): "
        f"{', '.join(builtin_pipelines())}.",
    )
    config: str | None = Field(default=None, description="Pipeline YAML file to serve.")
    model: str | None = Field(
        default=None,
        description="Local HF checkpoint folder (or a hub id whose snapshot is in the local "
        "Hugging Face cache), served as the pipeline its model family forms (one AR stage for "
        "a decoder-only model, thinker, talker and code2wav for a speaking omni model, a "
        "diffusion stage for a diffusers folder).",
    )
    served_model_name: Annotated[list[str], BeforeValidator(_names)] = Field(
        default_factory=list,
        description="Model id(s) reported by /v1/models, the first one in replies (default: "
        "the pipeline's name, or the checkpoint folder's); a request naming a model that is "
        "neither one of them nor a stage's checkpoint folder is a 404, as vLLM answers it.",
    )
    host: str = Field(default="127.0.0.1", description="Address to listen on.")
    port: int = Field(default=8000, ge=0, le=65535, description="Port to listen on.")
    enable_sleep_mode: bool = Field(default=False, description="Allow sleep/wake of every stage.")
    stream: bool | None = Field(
        default=None,
        description="--no-stream: hand every stage's output to the next whole, also where the "
        "pipeline streams it (speech is then synthesised in one piece, equal to the model's "
        "reference bit for bit, and its first audio comes after the whole reply); default: "
        "as the pipeline says (stream: true edges take their input chunk by chunk).",
    )
    auto_wake: bool = Field(
        default=False, description="Wake an asleep stage when a request needs it (instead of 503)."
    )
    idle_sleep_s: float | None = stage_flag("idle_sleep_s", note=" Level 1.")
    device: str | None = stage_flag("device")
    dtype: DTypeSetting | None = stage_flag("dtype")
    max_model_len: int | None = stage_flag("max_model_len")
    max_num_seqs: int | None = stage_flag("max_num_seqs")
    distributed_executor_backend: Literal["mp", "ray"] = Field(
        default="mp",
        description="How stages start: 'mp', processes of this machine; 'ray', Ray actors "
        "(RAY_ADDRESS, a running cluster, or a local one; also chosen by a stage's "
        "'placement').",
    )
    tensor_parallel_size: int | None = stage_flag("tensor_parallel_size")
    max_num_batched_tokens: int | None = stage_flag("max_num_batched_tokens")
    gpu_memory_utilization: float | None = stage_flag("gpu_memory_utilization")
    kv_cache_memory: ByteCount | None = stage_flag("kv_cache_memory")
    max_answer_logprobs: int | None = stage_flag("max_answer_logprobs")
    max_request_tokens: int | None = stage_flag("max_request_tokens")
    enable_prefix_caching: bool | None = stage_flag("enable_prefix_caching")
    enforce_eager: bool | None = stage_flag("enforce_eager")
    attention_backend: AttentionBackendName | None = stage_flag("attention_backend")
    omni: bool = Field(
        default=False,
        description="Accepted for vLLM-Omni's command line; every omnistage server serves "
        "the whole multi-stage pipeline.",
    )
    api_key: str | None = Field(
        default=None,
        min_length=1,
        description="Key demanded by every route but /health and /metrics "
        "(default: $OMNISTAGE_API_KEY).",
    )
    control_api_key: str | None = Field(
        default=None,
        min_length=1,
        description="Key demanded by control routes (default: $OMNISTAGE_CONTROL_API_KEY).",
    )
    chat_dialect: Literal["auto", "openai", "vllm-omni"] = Field(
        default="auto",
        description="Shape of chat replies: 'openai' (one choice carrying text, audio and "
        "images; speech streamed as delta.audio), 'vllm-omni' (a choice per output modality; "
        "stream chunks tagged with 'modality', speech in delta.content), or 'auto': OpenAI's "
        "shape for a request with OpenAI's 'audio' object, vLLM-Omni's for any other.",
    )
    default_modalities: list[Literal["text", "image", "audio"]] | None = Field(
        default=None,
        description="Outputs a chat request without 'modalities' asks for (those the pipeline "
        "produces; unset: every output it produces, as vLLM-Omni).",
    )
    max_video_jobs: int = Field(
        default=64,
        ge=1,
        description="Video jobs (POST /v1/videos) kept at once; when full the oldest finished "
        "one makes room, and with every kept job unfinished a new one is a 429.",
    )
    video_job_ttl_s: float = Field(
        default=3600.0,
        gt=0,
        description="How long a finished video job (and its MP4) is kept after it finished.",
    )
    video_storage_dir: str | None = Field(
        default=None,
        description="Folder for the MP4s of video jobs (default: a folder of the server's "
        "own, removed when it stops).",
    )
    voice_storage_dir: str | None = Field(
        default=None,
        description="Folder of the voices uploaded through POST /v1/audio/voices, kept across "
        "restarts (default: voices/ beside the model cache folder).",
    )
    max_uploaded_voices: int = Field(
        default=100,
        ge=1,
        description="Uploaded voices kept at once; an upload past it is refused (400) until "
        "one is deleted.",
    )
    max_voice_upload_bytes: int = Field(
        default=10 * 1024 * 1024,
        ge=1024,
        description="Largest clip an uploaded voice may have, in bytes.",
    )
    trust_request_chat_template: bool = Field(
        default=False,
        description="Render a chat request's own chat_template (sandboxed, as the "
        "checkpoint's); without this flag such a request is refused (400), as vLLM does.",
    )
    max_request_body_bytes: int | None = Field(
        default=None,
        gt=0,
        description="Largest request body accepted; larger ones get 413 (default: room for "
        "one inline medium of --max-media-bytes, base64, plus 1 MiB).",
    )
    max_image_pixels: int | None = stage_flag("max_image_pixels")
    stage_replicas: list[str] | None = Field(
        default=None,
        description="STAGE=N entries: run stage STAGE (its id or name) as N replicas, each a "
        "process of its own with its own weights, requests balanced over them (a pipeline "
        "file's replicas: N).",
    )
    max_stage_restarts: int = Field(
        default=3,
        ge=0,
        description="Restarts of a stage whose process died, within --stage-restart-window-s "
        "(0: a dead stage stays dead).",
    )
    stage_restart_window_s: float = Field(
        default=600.0, gt=0, description="Window over which --max-stage-restarts counts."
    )
    paused_request_timeout_s: float = Field(
        default=300.0,
        gt=0,
        description="Longest a request waits for a paused stage to resume (POST "
        "/v1/omni/pause, an RL loop's pause); then it is refused with 503 stage_paused.",
    )
    stage_init_timeout_s: float = Field(
        default=600.0, gt=0, description="Longest wait for a stage to start."
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        default="info", description="Level of omnistage's (and uvicorn's) log lines."
    )
    log_format: Literal["text", "json"] = Field(
        default="text",
        description="Log lines as text (time, level, logger, message) or as JSON objects.",
    )
    disable_log_requests: bool = Field(
        default=False, description="No log line per request (errors are still logged)."
    )
    no_ui: bool = Field(
        default=False,
        description="Do not serve the operator console and playground at /ui (the page calls "
        "the routes with the keys its user types; see docs/ui.md).",
    )

    @field_validator("api_key", "control_api_key")
    @classmethod
    def _no_blank_key(cls, value: str | None) -> str | None:
        if value is not None and value.strip() != value:
            raise ValueError("must not be blank or have surrounding whitespace")
        return value

    @model_validator(mode="after")
    def _one_source(self) -> ServerConfig:
        given = [n for n in ("pipeline", "config", "model") if getattr(self, n)]
        if len(given) > 1:
            raise ValueError(
                f"give only one of --pipeline, --config, --model (got {', '.join(given)})"
            )
        return self

    @field_validator("served_model_name")
    @classmethod
    def _nonempty_names(cls, value: list[str]) -> list[str]:
        if not all(name.strip() for name in value):
            raise ValueError("names must not be empty")
        return value

    @property
    def model_name(self) -> str:
        """The model id replies carry: the first served name."""
        if self.served_model_name:
            return self.served_model_name[0]
        if self.model:
            from omnistage.models.hub import is_hub_id

            return self.model if is_hub_id(self.model) else Path(self.model).name
        if self.config:
            return _pipeline_name(self.config)
        return self.pipeline or "tiny-omni"

    @property
    def request_body_limit(self) -> int:
        """``max_request_body_bytes``, or room for one base64 medium of ``max_media_bytes``
        and the rest of the request: the two limits never contradict each other."""
        if self.max_request_body_bytes is not None:
            return self.max_request_body_bytes
        return -(-self.max_media_bytes // 3) * 4 + 1024 * 1024

    @property
    def model_names(self) -> list[str]:
        """Every model id /v1/models lists (``--served-model-name`` may give several)."""
        return list(self.served_model_name or [self.model_name])

    def stage_overrides(self) -> dict[str, object]:
        """Stage settings the flags give every stage (``None``: the stage's own stays)."""
        overrides: dict[str, object] = {flag: getattr(self, flag) for flag in STAGE_FLAGS}
        if self.enable_sleep_mode:
            overrides["enable_sleep_mode"] = True
        if self.stream is False:
            overrides["stream"] = False
        return {k: v for k, v in overrides.items() if v is not None}

    def pipeline_config(self, on_build: object = None) -> PipelineConfig:
        """Resolve the pipeline to serve; builds missing built-in models (telling ``on_build``)
        and checks what can be checked before a stage starts (``ConfigError``)."""
        from omnistage.stage.kinds import preflight

        config = with_replicas(self._pipeline_config(on_build), self.stage_replicas or [])
        preflight(config)
        return config

    def _pipeline_config(self, on_build: object) -> PipelineConfig:
        from omnistage.pipelines import (
            ensure_models,
            load_pipeline,
            pipeline_from_file,
            pipeline_from_model,
        )

        overrides = self.stage_overrides()
        if self.model:
            from omnistage.models.hub import resolve_model_path

            folder = resolve_model_path(self.model)
            config = pipeline_from_model(folder, self.model_name, **overrides)
            ensure_models(config)
            return config
        if self.config:
            config = pipeline_from_file(self.config, **overrides)
            ensure_models(config, on_build)  # type: ignore[arg-type]
            return config
        return load_pipeline(self.pipeline or "tiny-omni", on_build=on_build, **overrides)  # type: ignore[arg-type]


def with_replicas(config: PipelineConfig, entries: list[str]) -> PipelineConfig:
    """``config`` with the replica counts of ``--stage-replicas`` (``STAGE=N``, STAGE a stage
    id or display name; ``ConfigError`` naming the flag)."""
    from omnistage.config import ConfigError

    if not entries:
        return config
    stages = list(config.stages)
    for entry in entries:
        key, sep, count = entry.partition("=")
        named = [s for s in stages if key.strip() in (str(s.stage_id), s.name, s.display_name)]
        if not sep or not count.strip().isdigit() or len(named) != 1:
            raise ConfigError(
                f"--stage-replicas: {entry!r} is not STAGE=N with STAGE one stage's id or name "
                f"({[s.display_name for s in stages]})"
            )
        stage = named[0]
        try:
            stages[stage.stage_id] = StageConfig.model_validate(
                {**stage.model_dump(exclude_unset=True), "replicas": int(count)}
            )
        except ValueError as exc:
            raise ConfigError(f"--stage-replicas: {entry!r}: {exc}") from None
    return config.model_copy(update={"stages": stages})


def _pipeline_name(path: str) -> str:
    """A pipeline file's own ``name``, else its file's stem (a file that cannot be read is
    reported, naming it, when the pipeline is loaded)."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return Path(path).stem
    name = data.get("name") if isinstance(data, dict) else None
    return name.strip() if isinstance(name, str) and name.strip() else Path(path).stem
