"""The same request with the same seed gives the same bytes under any load (CPU).

A request's results must not depend on what else shares its batch: an AR stage's tokens and
final hidden states (which condition the image stage: a text+image request's PNG is only as
reproducible as they are) and a diffusion stage's images. CPU kernels choose algorithms by
shape, so each source of batch dependence is removed where it arises. Measured on Intel
Sapphire/Emerald Rapids (AVX-512), torch 2.13 (MKL 2024.2, oneDNN 3.12), fp32:

- **MKL GEMMs.** A row of ``F.linear`` depends on the number of rows M in complicated,
  CPU-specific ways (by default almost every M tried, 2..300, changed the first row's last
  bits). MKL's Conditional Numerical Reproducibility in strict mode, ``MKL_CBWR=AUTO,STRICT``,
  makes every row bit-identical for every M tried (1..2048, K from 64 to 4864, N from 64 to
  151936, 1 to 16 threads).
  MKL reads the variable once, at its first GEMM or convolution; ``mkl_cbwr_set`` cannot be
  called instead (MKL's symbols are hidden inside libtorch_cpu.so). So ``import omnistage``
  sets it in the environment (``enable_strict_cnr``): stage processes are spawned, import
  omnistage before torch does any math, and pass the environment on to their children. In
  a process that ran a GEMM before importing omnistage, MKL stays in its default mode.
  Cost: GEMMs of two or more rows run about as fast as before (some faster), but single-row
  GEMMs take about twice as long (one row through an LM-head-sized 896 x 151936 GEMM: 66 ms
  instead of 34 ms on one thread, 35 ms instead of 17 ms on two; no other CNR branch is
  faster). Decoding the tiny demo model, 32 sequences at once ran 1-7% slower, one sequence
  alone 22% slower. ``OMNISTAGE_BATCH_INVARIANT=0`` (or any ``MKL_CBWR`` of the user's own,
  which is left alone) keeps MKL's default mode and that speed, and gives up bit-identity.
- **AR decode attention** (the ``torch_sdpa`` backend, ``omnistage/models/attention.py``). The CPU SDPA kernel splits
  keys into 512-slot chunks and its sums change with the length of the last chunk, masked
  slots included; a batch padded to its widest block table changed a 1000-token sequence's
  result. On the CPU each sequence attends over exactly its own blocks (sequences with as
  many blocks share a call); prefill already attends per sequence.
- **silu** (``omnistage/models/decoder.py``). ATen splits elementwise ops into one chunk per
  thread whose last partial SIMD step takes the scalar function; silu's scalar ``std::exp``
  rounds differently from the SIMD one, and where chunks end depends on the number of
  tokens. The MLP pads its silu rows so that every chunk is whole SIMD steps (``rowwise``).
  (cos, sin and exp take the SIMD path for every element already; RMSNorm reduces each row
  on one thread in a fixed order; embedding, rotary, residual and masking arithmetic are
  exact elementwise ops.)
- **Diffusion** (``omnistage/stage/diffusion/batch_invariance.py``): oneDNN convolutions
  round per batch size, strict CNR or not, so the denoiser runs with oneDNN off; the VAE
  decodes one image at a time.

Not covered: CUDA (cuBLAS and cuDNN choose kernels by shape; expect agreement to about 1e-6);
bf16/fp16 on the CPU (their GEMMs and fp16 attention go through oneDNN, whose row invariance
was not measured); preemption (a recomputed prefill covers prompt and output tokens at once).
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

SWITCH_ENV = "OMNISTAGE_BATCH_INVARIANT"
MKL_CBWR_ENV = "MKL_CBWR"
STRICT_CNR = "AUTO,STRICT"
_OFF = {"0", "false", "no", "off"}


def enable_strict_cnr(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``MKL_CBWR=AUTO,STRICT`` unless ``MKL_CBWR`` is set already or
    ``OMNISTAGE_BATCH_INVARIANT`` is off (0/false/no/off). Returns whether MKL_CBWR ends up
    strict. Takes effect only before MKL's first call in this process."""
    env = os.environ if environ is None else environ
    if env.get(SWITCH_ENV, "").strip().lower() not in _OFF:
        env.setdefault(MKL_CBWR_ENV, STRICT_CNR)
    return env.get(MKL_CBWR_ENV, "").replace(" ", "").upper().endswith("STRICT")
