"""What an AR stage resolves when it starts (see ``omnistage.stage.resolve``):
``max_model_len`` defaults to the checkpoint's ``max_position_embeddings`` and may not exceed
it — positions past it were never trained."""

from __future__ import annotations

from omnistage.config import ConfigError, StageConfig
from omnistage.errors import CheckpointError
from omnistage.models.ar_config import ARModelConfig
from omnistage.stage.resolve import resolve_dtype


def resolve_max_model_len(stage: StageConfig, model: ARModelConfig) -> int:
    limit = model.max_position_embeddings
    if stage.ar.max_model_len is None:
        return limit
    if stage.ar.max_model_len > limit:
        raise ConfigError(
            f"stage {stage.stage_id}: max_model_len ({stage.ar.max_model_len}) is larger than "
            f"the checkpoint's max_position_embeddings ({limit}) in {stage.model}; "
            f"use at most {limit}"
        )
    return stage.ar.max_model_len


def resolve_ar_stage(stage: StageConfig, model: ARModelConfig) -> StageConfig:
    """The AR stage as it runs: dtype and max_model_len resolved."""
    options = stage.ar.model_copy(update={"max_model_len": resolve_max_model_len(stage, model)})
    return stage.model_copy(
        update={"dtype": resolve_dtype(stage, model.torch_dtype), "ar": options}
    )


def check_generation_config(stage: StageConfig) -> None:
    """``override_generation_config`` holds sampling parameters (``ConfigError`` naming the
    key otherwise)."""
    from omnistage.errors import InvalidRequestError
    from omnistage.stage.ar.sampling_params import SamplingParams

    key = f"stages.{stage.stage_id}.ar.override_generation_config"
    overrides = stage.ar.override_generation_config
    unknown = sorted(set(overrides) - set(SamplingParams.__struct_fields__))
    if unknown:
        raise ConfigError(
            f"{key}.{unknown[0]}: not a sampling parameter; known: "
            f"{sorted(SamplingParams.__struct_fields__)}"
        )
    try:
        SamplingParams(**overrides)
    except (InvalidRequestError, TypeError) as exc:
        raise ConfigError(f"{key}: {exc}") from None


def check_limits(stage: StageConfig) -> None:
    """Fail early (``ConfigError``, before any stage starts) on a ``max_model_len`` the
    checkpoint cannot serve or sampling defaults that are not; an unreadable checkpoint is
    left for the stage to report."""
    check_generation_config(stage)
    if stage.ar.max_model_len is None:
        return
    try:
        model = ARModelConfig.from_pretrained(stage.model, stage.model_stage)
    except (CheckpointError, OSError, ValueError):
        return
    resolve_max_model_len(stage, model)
