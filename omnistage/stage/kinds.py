"""The one map of stage kinds: everything that differs between an AR, a diffusion and a
code2wav stage, and the only place that lists them.

A kind is a package under ``omnistage.stage`` (its wire structs in ``<kind>/wire.py``, its
request preparer, worker and engine) plus one entry here. Code elsewhere asks the spec
(``stage_kind(config.kind)``) instead of branching on a kind's name, and the wire unions
(``StageRequest``, ``StageInfo``, ``MediaOutput``) are assembled from this map. Engines and
preparers are named by import path and imported only when used: a stage process imports
only what its kind needs, and the API process never imports an engine.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Union

from omnistage.config import ConfigError, PipelineConfig, StageConfig


@dataclass(frozen=True)
class KindSpec:
    """``engine`` builds the stage engine from a ``StageConfig`` (in the stage process);
    ``preparer`` validates and builds wire requests in the API process; ``wire`` is the module
    of the kind's wire structs (``REQUEST``, ``INFO`` and ``OUTPUT``: its media, a union of
    structs when it makes several, None when it returns tokens); ``modality`` is what it
    outputs; ``has_prefix_cache`` whether it keeps one (``reset_prefix_cache``);
    ``tensor_parallel`` whether its model splits over ranks;
    ``takes_stream`` whether it can take its input while the stage before produces it;
    ``preflight`` checks a stage config before any stage starts. Everything is named by import
    path and loaded when used: a server reads the map before it imports torch."""

    name: str
    engine: str
    preparer: str
    wire: str
    modality: str
    has_prefix_cache: bool = False
    tensor_parallel: bool = False
    takes_stream: bool = False
    preflight: str | None = None

    def build_engine(self, config: StageConfig, **options: Any) -> Any:
        return _load(self.engine)(config, **options)

    def preparer_class(self) -> Any:
        return _load(self.preparer)

    @property
    def request_type(self) -> type:
        return _load(f"{self.wire}:REQUEST")

    @property
    def info_type(self) -> type:
        return _load(f"{self.wire}:INFO")

    @property
    def output_type(self) -> type | None:
        return _load(f"{self.wire}:OUTPUT")


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


STAGE_KINDS: dict[str, KindSpec] = {
    spec.name: spec
    for spec in (
        KindSpec(
            name="ar",
            engine="omnistage.stage.ar.engine:ARStageEngine",
            preparer="omnistage.stage.ar.request_preparer:ARRequestPreparer",
            wire="omnistage.stage.ar.wire",
            modality="text",
            has_prefix_cache=True,
            tensor_parallel=True,
            preflight="omnistage.stage.ar.resolve:check_limits",
            takes_stream=True,  # its prompt and decode embeddings (a talker's)
        ),
        KindSpec(
            name="diffusion",
            engine="omnistage.stage.diffusion.engine:DiffusionStageEngine",
            preparer="omnistage.stage.diffusion.request_preparer:DiffusionRequestPreparer",
            wire="omnistage.stage.diffusion.wire",
            modality="image",
        ),
        KindSpec(
            name="code2wav",
            engine="omnistage.stage.code2wav.engine:Code2WavStageEngine",
            preparer="omnistage.stage.code2wav.request_preparer:Code2WavRequestPreparer",
            wire="omnistage.stage.code2wav.wire",
            modality="audio",
            takes_stream=True,
        ),
    )
}


def stage_kind(name: str) -> KindSpec:
    try:
        return STAGE_KINDS[name]
    except KeyError:
        raise ConfigError(
            f"unknown stage kind {name!r}; known kinds: {sorted(STAGE_KINDS)}"
        ) from None


def wire_unions() -> tuple[Any, Any, Any]:
    """``(StageRequest, StageInfo, MediaOutput)``: the unions of every kind's wire structs."""
    specs = STAGE_KINDS.values()
    outputs = [s.output_type for s in specs if s.output_type is not None]
    return (
        Union[tuple(s.request_type for s in specs)],  # noqa: UP007 - built from the map
        Union[tuple(s.info_type for s in specs)],  # noqa: UP007
        Union[tuple(outputs)],  # noqa: UP007
    )


def check_kinds(pipeline: PipelineConfig) -> PipelineConfig:
    """Every stage names a known kind, and only kinds that split over ranks ask for more
    than one (``ConfigError`` naming the key)."""
    for stage in pipeline.stages:
        key = f"stages.{stage.stage_id}"
        if stage.kind not in STAGE_KINDS:
            raise ConfigError(
                f"{key}.kind: unknown stage kind {stage.kind!r}; known kinds: {sorted(STAGE_KINDS)}"
            )
        if stage.tensor_parallel_size > 1 and not STAGE_KINDS[stage.kind].tensor_parallel:
            raise ConfigError(
                f"{key}.tensor_parallel_size: a {stage.kind!r} stage runs on one rank; "
                f"tensor parallelism applies to {tensor_parallel_kinds()} stages"
            )
        if stage.stream and not STAGE_KINDS[stage.kind].takes_stream:
            takers = [name for name, spec in STAGE_KINDS.items() if spec.takes_stream]
            raise ConfigError(
                f"{key}.stream: a {stage.kind!r} stage takes its input whole; {takers} "
                "stages take it streamed"
            )
    return pipeline


def preflight(pipeline: PipelineConfig) -> None:
    """Each kind's own checks of its stages that can run before any stage starts
    (``ConfigError``): an AR stage's ``max_model_len`` against its checkpoint."""
    for stage in check_kinds(pipeline).stages:
        spec = STAGE_KINDS[stage.kind]
        if spec.preflight is not None:
            _load(spec.preflight)(stage)


def tensor_parallel_kinds() -> list[str]:
    return [name for name, spec in STAGE_KINDS.items() if spec.tensor_parallel]
