"""Make a request's image independent of how many requests share its batch, bit for bit.

CPU kernels pick algorithms by shape, so the same request alone and inside a batch of four
would differ in the last bits and, after PNG quantisation, in a few pixels. Measured here
(x86, MKL, oneDNN) and fixed at the source:

- GEMMs with fewer than four rows take a different path (the timestep-embedding layers see
  one row per request): those inputs are zero-padded to four rows; rows of GEMMs with >= 4
  rows were bit-identical for every row count tried (4..2048).
- oneDNN convolutions (the denoiser's patch embedding) round per batch size: the denoiser
  runs with oneDNN off, so convolutions take ATen's per-sample im2col + GEMM path.
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
from torch import nn
from torch.nn import functional

MIN_GEMM_ROWS = 4


class _RowPaddedLinear(nn.Linear):
    """``nn.Linear`` whose inputs with fewer than ``MIN_GEMM_ROWS`` rows are zero-padded."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = x.shape[-1]
        rows = x.numel() // features if features else 0
        if rows == 0 or rows >= MIN_GEMM_ROWS:
            return super().forward(x)
        padded = functional.pad(x.reshape(rows, features), (0, 0, 0, MIN_GEMM_ROWS - rows))
        return super().forward(padded)[:rows].reshape(*x.shape[:-1], -1)


def pad_small_gemms(module: nn.Module) -> int:
    """Switch every plain ``nn.Linear`` inside ``module`` to row padding; returns how many.

    Only the class changes (same parameters, same state-dict names), so adopted arena
    tensors and the loader are unaffected.
    """
    count = 0
    for mod in module.modules():
        if type(mod) is nn.Linear:
            mod.__class__ = _RowPaddedLinear
            count += 1
    return count


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
