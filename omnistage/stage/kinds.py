"""One map of stage kinds: everything that differs between an AR and a diffusion stage.

Code elsewhere asks the spec (``stage_kind(config.kind)``) instead of branching on the kind's
name, so a new kind (an audio decoder, say) is one entry here plus its own package. Engines
and request preparers are named by import path and imported only when used: a stage process
imports only what its kind needs, and the API process never imports an engine.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any

from omnistage.config import StageConfig
from omnistage.stage.messages import ARStageRequest, Code2WavStageRequest, DiffusionStageRequest


@dataclass(frozen=True)
class StageKind:
    """``engine`` builds the stage engine from a ``StageConfig`` (in the stage process);
    ``preparer`` validates and builds wire requests in the API process; ``request_type`` is
    the wire request the engine takes; ``modality`` is what the stage outputs;
    ``has_prefix_cache`` whether it keeps one (``reset_prefix_cache``);
    ``resumes_after_wake`` says whether a woken stage schedules again by itself (a diffusion
    stage) or waits for ``resume`` (an AR stage, whose caller decides when)."""

    name: str
    engine: str
    preparer: str
    request_type: type
    modality: str
    resumes_after_wake: bool
    has_prefix_cache: bool = False

    def build_engine(self, config: StageConfig, **options: Any) -> Any:
        return _load(self.engine)(config, **options)

    def preparer_class(self) -> Any:
        return _load(self.preparer)


def _load(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


STAGE_KINDS: dict[str, StageKind] = {
    "ar": StageKind(
        name="ar",
        engine="omnistage.stage.ar.engine:ARStageEngine",
        preparer="omnistage.stage.ar.prepare:ARRequestPreparer",
        request_type=ARStageRequest,
        modality="text",
        resumes_after_wake=False,
        has_prefix_cache=True,
    ),
    "diffusion": StageKind(
        name="diffusion",
        engine="omnistage.stage.diffusion.engine:DiffusionStageEngine",
        preparer="omnistage.stage.diffusion.prepare:DiffusionRequestPreparer",
        request_type=DiffusionStageRequest,
        modality="image",
        resumes_after_wake=True,
    ),
    "code2wav": StageKind(
        name="code2wav",
        engine="omnistage.stage.code2wav.engine:Code2WavStageEngine",
        preparer="omnistage.stage.code2wav.prepare:Code2WavRequestPreparer",
        request_type=Code2WavStageRequest,
        modality="audio",
        resumes_after_wake=True,
    ),
}


def stage_kind(name: str) -> StageKind:
    try:
        return STAGE_KINDS[name]
    except KeyError:
        raise ValueError(f"unknown stage kind {name!r}; known: {sorted(STAGE_KINDS)}") from None
