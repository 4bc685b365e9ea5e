"""Make a request's image independent of how many requests share its batch, bit for bit.

CPU kernels pick algorithms by shape, so the same request alone and inside a batch of four
would differ in the last bits and, after PNG quantisation, in a few pixels. Measured (torch
2.13, MKL 2024.2, oneDNN 3.12) on Intel Sapphire/Emerald Rapids (AVX-512) and an AMD EPYC
(AVX2 only), and fixed at the source:

- MKL GEMMs: a row's result depends on the number of rows in CPU-specific ways (the
  timestep-embedding layers see one row per request, two guided; attention and MLPs many).
  On Intel, MKL's strict CNR mode, which ``import omnistage`` switches on
  (``omnistage/batch_invariance.py``), makes every row bit-identical for every row count tried
  (1..2048). On the EPYC it leaves one row, 2..3 rows and 4+ rows apart (and layers with
  fewer than 12 output features per thread depend on the row count further): a request
  alone and beside three others differed in its PNG. Every stage process replaces
  ``F.linear`` with ``omnistage/models/invariant_linear.py``'s, which pads those calls into
  the 4+ rows class. One denoising step of the tiny image preset (CPU time, one thread):
  6.8 -> 7.3 ms unguided, 9.5 -> 10.2 ms guided, 26.2 -> 27.2 ms for four guided requests.
- Convolutions (the denoiser's patch embedding): oneDNN's round per batch size (batch 1
  against 2+ on the EPYC), strict CNR or not (it governs MKL only); without oneDNN, NNPACK
  takes stride-1 convolutions of 16+ samples (a patch size of 1) and rounds otherwise too.
  The denoiser runs with both off (``batch_invariant_kernels``), so convolutions take ATen's
  per-sample im2col + GEMM path, the same for batch 1..64.
- The VAE's convolutions and group norms differ per batch size too; the denoising loop
  decodes one image at a time instead (see ``denoise.py``).

On CUDA, cuBLAS and cuDNN choose kernels by shape as well; expect agreement to about 1e-6
there rather than bit-identity.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch


class _KernelSwitch:
    """Counts the blocks that need oneDNN and NNPACK off. The flags are process-wide and stage
    engines may be threads of one process: they go off with the first block and come back as
    found when the last one ends, so an overlapping block neither sees them on nor leaves them
    off."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._num_blocks = 0
        self._previous = (True, True)

    def enter(self) -> None:
        with self._lock:
            if self._num_blocks == 0:
                self._previous = (
                    bool(torch.backends.mkldnn.enabled),
                    bool(torch._C._get_nnpack_enabled()),
                )
                torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # ContextProp
                torch.backends.nnpack.set_flags(False)
            self._num_blocks += 1

    def leave(self) -> None:
        with self._lock:
            self._num_blocks -= 1
            if self._num_blocks == 0:
                onednn, nnpack = self._previous
                torch.backends.mkldnn.enabled = onednn  # type: ignore[assignment]
                torch.backends.nnpack.set_flags(nnpack)


_KERNELS = _KernelSwitch()


@contextlib.contextmanager
def batch_invariant_kernels(device: torch.device) -> Iterator[None]:
    """On CPU, turn oneDNN and NNPACK off for the block (process-wide, see ``_KernelSwitch``)."""
    if device.type != "cpu":
        yield
        return
    _KERNELS.enter()
    try:
        yield
    finally:
        _KERNELS.leave()
