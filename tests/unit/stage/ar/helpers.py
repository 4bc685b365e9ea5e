"""Shared helpers for the AR engine tests: tiny checkpoints, engines, and a driver loop."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from omnistage.config import StageConfig
from omnistage.models.tiny_ar import TinyARSpec, build
from omnistage.stage.ar.engine import ARStageEngine
from omnistage.stage.ar.sampling_params import SamplingParams
from omnistage.stage.ar.sequence import ARRequest
from omnistage.stage.types import StageOutput

# Small enough that a decode step costs about a millisecond, with the demo's tokenizer size.
MICRO = TinyARSpec(64, 2, 4, 2, 128, 512, tie_word_embeddings=False, max_position_embeddings=512)


def build_micro(folder: Path) -> Path:
    return build(MICRO, folder)


def make_engine(model: Path, **overrides: object) -> ARStageEngine:
    fields: dict[str, object] = {
        "stage_id": 0,
        "kind": "ar",
        "model": str(model),
        "enable_sleep_mode": True,
        "kv_cache_bytes": 4 << 20,
        "max_model_len": 256,
    }
    fields.update(overrides)
    return ARStageEngine(StageConfig(**fields), seed=0)  # type: ignore[arg-type]


def greedy(max_tokens: int, **kwargs: object) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kwargs)  # type: ignore[arg-type]


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    final: StageOutput | None = None


def collect(outputs: list[StageOutput], results: dict[str, Result]) -> None:
    for out in outputs:
        result = results.setdefault(out.request_id, Result())
        result.token_ids += out.new_token_ids
        result.text += out.text_delta
        if out.finished:
            result.finish_reason = out.finish_reason
            result.final = out


def run_to_completion(
    engine: ARStageEngine, results: dict[str, Result] | None = None
) -> dict[str, Result]:
    results = {} if results is None else results
    while engine.has_unfinished_requests():
        outputs = engine.step()
        if not outputs and engine.has_unfinished_requests() and not engine.has_runnable_work():
            raise AssertionError(f"engine made no progress: {engine.status()}")
        collect(outputs, results)
    return results


def generate(engine: ARStageEngine, requests: list[ARRequest]) -> dict[str, Result]:
    for request in requests:
        engine.add_request(request)
    return run_to_completion(engine)
