"""Built-in pipelines: YAML configs whose tiny models are built on first use.

``{cache}`` in a model path is the model cache folder: ``$OMNISTAGE_CACHE_DIR`` or
``~/.cache/omnistage/models``. A stage with a ``preset`` gets its model built there
(deterministically) if it is not there yet.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from omnistage.config import ConfigError, PipelineConfig, apply_overrides, parse_pipeline_config

_STAGE_OVERRIDES = frozenset(
    {
        "device",
        "dtype",
        "enable_sleep_mode",
        "torch_threads",
        "tensor_parallel_size",
        "drain_timeout_s",
        "max_num_seqs",
        "max_num_batched_tokens",
        "max_model_len",
        "gpu_memory_utilization",
        "kv_cache_bytes",
        "enable_prefix_caching",
        "idle_sleep_s",
        "idle_sleep_level",
        "max_image_pixels",
        "max_inference_steps",
    }
)


def cache_dir() -> Path:
    return Path(
        os.environ.get("OMNISTAGE_CACHE_DIR") or Path.home() / ".cache" / "omnistage" / "models"
    )


def builtin_pipelines() -> list[str]:
    return sorted(
        p.name.removesuffix(".yaml")
        for p in resources.files(__package__).iterdir()
        if p.name.endswith(".yaml")
    )


def load_pipeline(
    name: str,
    *,
    build: bool = True,
    on_build: Callable[[str, Path], None] | None = None,
    **overrides: Any,
) -> PipelineConfig:
    """The built-in pipeline ``name`` with ``overrides`` applied to every stage.

    ``build`` makes missing preset models now; ``on_build(preset, path)`` is told first.
    """
    if name not in builtin_pipelines():
        raise ConfigError(f"unknown pipeline {name!r}; built-in pipelines: {builtin_pipelines()}")
    unknown = set(overrides) - _STAGE_OVERRIDES
    if unknown:
        raise ConfigError(
            f"unknown pipeline overrides {sorted(unknown)}; allowed: {sorted(_STAGE_OVERRIDES)}"
        )
    data = yaml.safe_load(resources.files(__package__).joinpath(f"{name}.yaml").read_text())
    cache = cache_dir()
    for stage in data["stages"]:
        stage["model"] = stage["model"].format(cache=cache)
    data["stages"] = [apply_overrides(stage, overrides) for stage in data["stages"]]
    config = parse_pipeline_config(data, source=f"pipeline {name}")
    if build:
        ensure_models(config, on_build)
    return config


def ensure_models(
    config: PipelineConfig, on_build: Callable[[str, Path], None] | None = None
) -> None:
    """Build every stage's preset model that is not built yet; a stage without a preset must
    name an existing checkpoint (``ConfigError`` naming the key otherwise)."""
    from omnistage.models.tiny import ensure_preset, is_built

    for stage in config.stages:
        if stage.preset is None and not Path(stage.model).exists():
            raise ConfigError(f"stages.{stage.stage_id}.model: no such checkpoint: {stage.model}")
        if stage.preset is not None and not is_built(stage.model):
            if on_build is not None:
                on_build(stage.preset, Path(stage.model))
            ensure_preset(stage.preset, stage.model)


def pipeline_from_model(folder: str, name: str | None = None, **overrides: Any) -> PipelineConfig:
    """The pipeline a checkpoint folder asks for: a Qwen2.5-Omni folder gives three stages —
    ``thinker`` (ar) → ``talker`` (ar, fed the thinker's embeddings and hidden states) →
    ``code2wav`` (speech codes to a 24 kHz waveform) —, any other model one AR stage.
    ``overrides`` go to every stage (as ``load_pipeline``'s)."""
    from omnistage.models.qwen_omni import is_qwen_omni

    if is_qwen_omni(folder):
        stages: list[dict[str, Any]] = [
            {"stage_id": 0, "name": "thinker", "kind": "ar", "model_stage": "thinker"},
            {
                "stage_id": 1,
                "name": "talker",
                "kind": "ar",
                "model_stage": "talker",
                "input_from": 0,
                "input_processor": "thinker_to_talker",
                "enable_prefix_caching": False,
            },
            {
                "stage_id": 2,
                "name": "code2wav",
                "kind": "code2wav",
                "model_stage": "code2wav",
                "input_from": 1,
                "input_processor": "talker_to_code2wav",
            },
        ]
    else:
        stages = [{"stage_id": 0, "kind": "ar"}]
    stages = [apply_overrides({**stage, "model": folder}, overrides) for stage in stages]
    data = {"name": name or Path(folder).name, "stages": stages}
    return parse_pipeline_config(data, source=f"--model {folder}")
