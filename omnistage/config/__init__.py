"""Typed, validated configuration: a pipeline is an ordered list of stages.

Split by concern, as vLLM's ``vllm/config/``: ``values`` (byte counts, dtypes, the frozen
base), ``options`` (what only one stage kind takes), ``stage`` (a stage, a pipeline, loading
them). Configs reject unknown keys and bad values with the offending key named, and are frozen:
values resolved at start-up (KV blocks, thread counts) are returned by the code that resolves
them, never written back here.
"""

from omnistage.config.options import (
    KIND_OPTIONS,
    AROptions,
    Code2WavOptions,
    DiffusionOptions,
    option_kinds,
    option_name,
    same_setting_twice,
)
from omnistage.config.stage import (
    PipelineConfig,
    Placement,
    StageConfig,
    StreamChunks,
    load_pipeline_config,
    nest_options,
    offline_stage_config,
    parse_pipeline_config,
)
from omnistage.config.values import (
    DTYPE_ALIASES,
    AttentionBackendName,
    ByteCount,
    ConfigError,
    DType,
    DTypeSetting,
    parse_bytes,
)

__all__ = [
    "DTYPE_ALIASES",
    "KIND_OPTIONS",
    "AROptions",
    "AttentionBackendName",
    "ByteCount",
    "Code2WavOptions",
    "ConfigError",
    "DType",
    "DTypeSetting",
    "DiffusionOptions",
    "PipelineConfig",
    "Placement",
    "StageConfig",
    "StreamChunks",
    "load_pipeline_config",
    "nest_options",
    "offline_stage_config",
    "option_kinds",
    "option_name",
    "parse_bytes",
    "parse_pipeline_config",
    "same_setting_twice",
]
