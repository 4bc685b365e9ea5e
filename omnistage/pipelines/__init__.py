"""Pipelines to serve: the built-in ones (YAML configs whose tiny models are built on first
use), a user's pipeline file, or the pipeline a checkpoint folder asks for (its model family's,
``omnistage.models.registry``) — each with the flags given for every stage applied, and its
stage kinds checked against the kinds map before any stage starts.

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

from omnistage.config import (
    KIND_OPTIONS,
    ConfigError,
    PipelineConfig,
    StageConfig,
    load_pipeline_config,
    nest_options,
    option_kinds,
    option_name,
    parse_pipeline_config,
    same_setting_twice,
)
from omnistage.stage.kinds import STAGE_KINDS, check_kinds

# The settings given for every stage (server flags, ``Omni``/``AsyncOmni`` keywords): each
# reaches the stages that take it (a kind's option only that kind's stages).
_STAGE_OVERRIDES = frozenset(
    {
        "device",
        "dtype",
        "enable_sleep_mode",
        "torch_threads",
        "tensor_parallel_size",
        "drain_timeout_s",
        "idle_sleep_s",
        "idle_sleep_level",
        "stream",  # serve --no-stream: every hand-off whole
        *(name for options in KIND_OPTIONS.values() for name in options.model_fields),
    }
)


# The ways of sizing an AR stage's KV cache: a flag giving one replaces the stage's own.
_KV_SIZING = ("gpu_memory_utilization", "kv_cache_memory")


def check_overrides(overrides: dict[str, Any]) -> None:
    """Settings for every stage must be known ones (``ConfigError``), each given once by one
    of its names (``TypeError``, as a Python call refuses a keyword given twice)."""
    twice = same_setting_twice(overrides)
    if twice:
        raise TypeError(f"got {twice[0]} and {twice[1]} (the same setting); give one")
    unknown = {option_name(k) for k in overrides} - _STAGE_OVERRIDES
    if unknown:
        raise ConfigError(
            f"unknown pipeline overrides {sorted(unknown)}; allowed: {sorted(_STAGE_OVERRIDES)}"
        )


def apply_overrides(stage: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``stage`` (a stage mapping, its kind's options under its kind's key) with ``overrides``
    (settings given for every stage, flat) applied; ``None`` values leave the stage's own
    setting, a kind's option reaches only that kind's stages, and ``tensor_parallel_size``
    only the stages whose kind splits over ranks."""
    try:
        stage = nest_options(stage)
    except ValueError as exc:
        raise ConfigError(f"stages.{stage.get('stage_id')}: {exc}") from None
    kind = str(stage.get("kind"))
    given = {option_name(k): v for k, v in overrides.items() if v is not None}
    spec = STAGE_KINDS.get(kind)
    if spec is not None and not spec.tensor_parallel:  # the other kinds run on one rank
        given.pop("tensor_parallel_size", None)
    out = dict(stage)
    options = dict(out.get(kind) or {}) if kind in KIND_OPTIONS else {}
    if any(k in given for k in _KV_SIZING):
        for key in _KV_SIZING:
            options.pop(key, None)
    for key, value in given.items():
        if key in StageConfig.model_fields:
            out[key] = value
        elif kind in option_kinds(key):
            options[key] = value
    if options:
        out[kind] = options
    return out


def parse_pipeline(data: Any, source: str) -> PipelineConfig:
    """A pipeline mapping validated, its kinds checked (``ConfigError`` naming the key)."""
    return check_kinds(parse_pipeline_config(data, source=source))


def pipeline_from_file(path: str | Path, **overrides: Any) -> PipelineConfig:
    """A pipeline YAML file with ``overrides`` applied to every stage; its relative model
    paths resolved (``file_model_path``)."""
    check_overrides(overrides)
    base = load_pipeline_config(path)
    stages = []
    for stage in base.stages:
        data = stage.model_dump()
        data["model"] = file_model_path(data["model"], data.get("preset"), Path(path).parent)
        stages.append(apply_overrides(data, overrides))
    return parse_pipeline({"name": base.name, "stages": stages}, str(path))


def file_model_path(model: str, preset: str | None, folder: Path) -> str:
    """A pipeline file's ``model``: ``{cache}`` is the model cache; a relative path is read
    against the file's folder, or — a preset not built there yet — against the model cache
    (built there); never against the working directory (serving the example wrote
    ``models/`` into whatever folder it was run from)."""
    model = str(Path(model.replace("{cache}", str(cache_dir()))).expanduser())
    if Path(model).is_absolute():
        return model
    beside = (folder / model).resolve()
    if beside.exists() or preset is None:
        return str(beside)
    return str(cache_dir() / model)


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
    check_overrides(overrides)
    data = yaml.safe_load(resources.files(__package__).joinpath(f"{name}.yaml").read_text())
    cache = cache_dir()
    for stage in data["stages"]:
        stage["model"] = stage["model"].format(cache=cache)
    data["stages"] = [apply_overrides(stage, overrides) for stage in data["stages"]]
    config = parse_pipeline(data, source=f"pipeline {name}")
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
        if stage.preset is not None and not is_built(stage.model, stage.preset):
            if on_build is not None:
                on_build(stage.preset, Path(stage.model))
            ensure_preset(stage.preset, stage.model)


def pipeline_from_model(folder: str, name: str | None = None, **overrides: Any) -> PipelineConfig:
    """The pipeline a checkpoint folder asks for: its model family's (a decoder-only model:
    one AR stage; a Qwen2.5-Omni folder: thinker → talker → code2wav). ``overrides`` go to
    every stage (as ``load_pipeline``'s); an unknown model is a ``ConfigError`` naming the
    supported ones."""
    from omnistage.errors import CheckpointError
    from omnistage.models import registry

    check_overrides(overrides)
    try:
        stages = registry.family_of_folder(folder).pipeline()
    except CheckpointError as exc:
        raise ConfigError(f"--model {folder}: {exc}") from None
    stages = [apply_overrides({**stage, "model": folder}, overrides) for stage in stages]
    data = {"name": name or Path(folder).name, "stages": stages}
    return parse_pipeline(data, source=f"--model {folder}")
