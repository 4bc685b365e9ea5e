"""``F.linear`` whose rows do not depend on how many rows share the call (CPU, float32).

MKL picks its GEMM kernel, and how it splits the work over threads, by shape; strict CNR mode
(``omnistage/batch_invariance.py``) makes that harmless on Intel's AVX-512 CPUs but not on all:
on an AMD EPYC (AVX2) a row's last bits change with the number of rows M unless M >= 4 and
the layer has at least 12 output features per thread. ``linear`` runs every call in that
class: fewer than ``MIN_ROWS`` rows are zero-padded to ``MIN_ROWS``, and a layer narrower than
``COLUMNS_PER_THREAD`` times the thread count gets zero output features (weight rows, bias
entries) up to that width. Each output element is its own dot product, so the padding
changes no real one; it is cut off again.

``install`` puts ``linear`` in place of ``torch.nn.functional.linear`` for the process, so
every ``nn.Linear`` (transformers' and diffusers' modules included) and every direct
``F.linear`` call uses it — where a probe of ATen's own GEMMs on this CPU finds their rows
depending on the batch (``aten_rows_vary``): the padding costs single-row GEMMs about 3x, so a
CPU whose kernels are invariant already (Intel's AVX-512 under strict CNR, as measured there)
keeps ATen's. Other devices and dtypes go straight to ATen.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from omnistage.batch_invariance import is_on

# Fewer rows take other kernels (M = 1 and M = 2..3 each differ from M >= 4).
MIN_ROWS = 4
# With fewer output features per thread, MKL splits the rows over the threads instead, and a
# row's result depends on M (and on its place among the rows) up to hundreds of rows.
COLUMNS_PER_THREAD = 12

_ATEN_LINEAR = torch._C._nn.linear


def invariant_width() -> int:
    """The fewest output features (MKL's ``m``) a GEMM needs, with this thread's thread count,
    for its results not to depend on its other dimensions' sizes."""
    return COLUMNS_PER_THREAD * torch.get_num_threads()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, each row computed alike for every number of rows."""
    if (
        not x.is_cpu
        or x.dtype is not torch.float32
        or weight.dtype is not torch.float32
        or weight.dim() != 2
        or x.dim() == 0
        or x.shape[-1] != weight.shape[1]  # ATen says what is wrong
        or (bias is not None and bias.shape != weight.shape[:1])
    ):
        return _ATEN_LINEAR(x, weight, bias)
    out_features, features = weight.shape
    rows = x.numel() // features if features else 0
    width = invariant_width()
    if rows == 0 or (rows >= MIN_ROWS and out_features >= width):
        return _ATEN_LINEAR(x, weight, bias)
    flat = x if x.dim() == 2 else x.reshape(rows, features)
    if rows < MIN_ROWS:
        flat = torch.constant_pad_nd(flat, (0, 0, 0, MIN_ROWS - rows))
    if out_features < width:
        weight = torch.constant_pad_nd(weight, (0, 0, 0, width - out_features))
        if bias is not None:
            bias = torch.constant_pad_nd(bias, (0, width - out_features))
    out = _ATEN_LINEAR(flat, weight, bias)
    if out.shape != (rows, out_features):
        out = out[:rows, :out_features].contiguous()
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


@functools.cache
def aten_rows_vary(threads: int) -> bool:
    """Whether ATen's float32 ``linear`` on this CPU, with ``threads`` threads, gives a row
    other bits beside other rows than alone: narrow and wide layers, 2 to 300 rows, each of
    the first three rows against itself alone (a few milliseconds)."""
    generator = torch.Generator().manual_seed(0)
    for out_features in (8, 64, 1024):
        weight = torch.randn(out_features, 256, generator=generator)
        bias = torch.randn(out_features, generator=generator)
        x = torch.randn(300, 256, generator=generator)
        alone = [_ATEN_LINEAR(x[i : i + 1], weight, bias) for i in range(3)]
        for rows in (2, 3, 4, 5, 8, 17, 64, 300):
            out = _ATEN_LINEAR(x[:rows], weight, bias)
            if any(not torch.equal(out[i : i + 1], alone[i]) for i in range(min(rows, 3))):
                return True
    return False


def install() -> bool:
    """Make ``torch.nn.functional.linear`` the row-invariant ``linear`` for this process,
    unless ``OMNISTAGE_BATCH_INVARIANT`` is off or ATen's rows do not vary on this CPU
    (``aten_rows_vary``). Idempotent; returns whether it is in place."""
    if is_on() and aten_rows_vary(torch.get_num_threads()):
        F.linear = linear  # type: ignore[assignment]
        # TorchScript compiles a call of it as the ATen op (it cannot script ``linear``).
        torch.jit._builtins._register_builtin(linear, "aten::linear")
    return F.linear is linear
