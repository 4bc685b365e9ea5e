"""Make a request's image independent of how many requests share its batch, bit for bit.

CPU kernels pick algorithms by shape, so the same request alone and inside a batch of four
would differ in the last bits and, after PNG quantisation, in a few pixels. Measured here
(x86 Sapphire/Emerald Rapids, AVX-512, MKL 2024.2, oneDNN 3.12) and fixed at the source:

- MKL GEMMs: a row's result depends on the number of rows in CPU-specific ways (the
  timestep-embedding layers see one row per request, attention and MLPs many). MKL's strict
  CNR mode, which ``import omnistage`` switches on (``omnistage/batch_invariance.py``), makes
  every row bit-identical for every row count tried (1..2048). The zero-padding of GEMMs with
  fewer than four rows that this replaced is gone: it did not cover the larger row counts.
- oneDNN convolutions (the denoiser's patch embedding) round per batch size, strict CNR or not
  (it governs MKL only): the denoiser runs with oneDNN off (``batch_invariant_kernels``), so
  convolutions take ATen's per-sample im2col + GEMM path. An unguided request (one denoiser
  row) alone and in a batch of four differs in its PNG with oneDNN on.
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


class _OneDnnSwitch:
    """Counts the blocks that need oneDNN off. The flag is process-wide and stage engines may
    be threads of one process: it goes off with the first block and comes back as found when
    the last one ends, so an overlapping block neither sees it on nor leaves it off."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._num_blocks = 0
        self._previous = True

    def enter(self) -> None:
        with self._lock:
            if self._num_blocks == 0:
                self._previous = bool(torch.backends.mkldnn.enabled)
                torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # ContextProp
            self._num_blocks += 1

    def leave(self) -> None:
        with self._lock:
            self._num_blocks -= 1
            if self._num_blocks == 0:
                torch.backends.mkldnn.enabled = self._previous  # type: ignore[assignment]


_ONEDNN = _OneDnnSwitch()


@contextlib.contextmanager
def batch_invariant_kernels(device: torch.device) -> Iterator[None]:
    """On CPU, turn oneDNN off for the block (process-wide, see ``_OneDnnSwitch``)."""
    if device.type != "cpu":
        yield
        return
    _ONEDNN.enter()
    try:
        yield
    finally:
        _ONEDNN.leave()
