"""Whether a checkpoint tensor holds, or would hold in its target dtype, NaN or Inf."""

from __future__ import annotations

import torch

_FINITE_CHUNK = 1 << 24  # elements per finiteness check: bounds the float8 widening copy


def nonfinite_values(src: torch.Tensor, target_dtype: torch.dtype) -> str:
    """What in ``src`` is, or would become in ``target_dtype``, NaN or Inf ('' if nothing).

    A finite min and max bound every value, and NaN propagates to both, so one ``aminmax``
    pass per chunk answers; values are counted only in a chunk known to be bad.
    """
    if not src.is_floating_point() or src.numel() == 0:
        return ""
    limit = torch.finfo(src.dtype).max
    if target_dtype.is_floating_point:  # a narrower target turns large values into Inf
        limit = min(limit, torch.finfo(target_dtype).max)
    nonfinite = overflow = 0
    for chunk in src.reshape(-1).split(_FINITE_CHUNK):
        wide = chunk.float() if chunk.element_size() == 1 else chunk  # float8 cannot reduce
        low, high = torch.aminmax(wide)
        if -limit <= float(low) <= float(high) <= limit:  # False for NaN
            continue
        finite = torch.isfinite(wide)
        nonfinite += int(finite.numel() - finite.sum())
        overflow += int((finite & (wide.abs() > limit)).sum())
    found = [f"{nonfinite} non-finite (NaN/Inf) values"] if nonfinite else []
    found += [f"{overflow} values beyond the range of {target_dtype}"] if overflow else []
    return " and ".join(found)
