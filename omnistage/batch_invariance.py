"""The same request with the same seed gives the same bytes under any load (CPU): MKL's strict
reproducibility mode, set before torch's first GEMM (``enable_strict_cnr``), and the probe of
whether ATen's GEMM rows vary with the batch on this CPU (``aten_rows_vary``), which decides
whether stage processes pad their linear layers (``omnistage/models/invariant_linear.py``).
Every source of batch dependence, what removes it, what it costs and what is not covered:
``docs/batch-invariance.md``."""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

SWITCH_ENV = "OMNISTAGE_BATCH_INVARIANT"
MKL_CBWR_ENV = "MKL_CBWR"
STRICT_CNR = "AUTO,STRICT"
_OFF = {"0", "false", "no", "off"}


def is_on(environ: Mapping[str, str] | None = None) -> bool:
    """Whether batch invariance is wanted: ``OMNISTAGE_BATCH_INVARIANT`` is not off
    (0/false/no/off)."""
    env = os.environ if environ is None else environ
    return env.get(SWITCH_ENV, "").strip().lower() not in _OFF


def enable_strict_cnr(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``MKL_CBWR=AUTO,STRICT`` unless ``MKL_CBWR`` is set already or batch invariance
    is off (``is_on``). Returns whether MKL_CBWR ends up strict. Takes effect only before
    MKL's first call in this process."""
    env = os.environ if environ is None else environ
    if is_on(env):
        env.setdefault(MKL_CBWR_ENV, STRICT_CNR)
    return env.get(MKL_CBWR_ENV, "").replace(" ", "").upper().endswith("STRICT")
