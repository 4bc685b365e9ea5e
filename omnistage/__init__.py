"""omnistage: multi-stage omni-modality serving with per-stage sleep and wake.

The public names are imported lazily so ``import omnistage`` stays cheap (the stage
processes import only what their kind needs).

Importing omnistage switches MKL to its strict reproducible mode (``MKL_CBWR=AUTO,STRICT``,
unless ``MKL_CBWR`` is set or ``OMNISTAGE_BATCH_INVARIANT=0``) before torch does any math, so
a request's results do not depend on what shares its batch: see ``omnistage.batch_invariance``.
"""

from __future__ import annotations

import importlib
from typing import Any

from omnistage.batch_invariance import enable_strict_cnr

enable_strict_cnr()

__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "omnistage.entrypoints.llm",
    "SamplingParams": "omnistage.stage.ar.sampling_params",
    "RequestOutput": "omnistage.entrypoints.llm",
    "CompletionOutput": "omnistage.entrypoints.llm",
    "Logprob": "omnistage.entrypoints.llm",
    "Diffusion": "omnistage.entrypoints.diffusion",
    "DiffusionParams": "omnistage.stage.diffusion.params",
    "ImageOutput": "omnistage.stage.diffusion.params",
    "AsyncOmni": "omnistage.engine.async_omni",
    "Omni": "omnistage.entrypoints.omni",
    "PipelineConfig": "omnistage.config",
    "StageConfig": "omnistage.config",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'omnistage' has no attribute {name!r}")
