"""The same request with the same seed gives the same bytes under any load (CPU).

A request's results must not depend on what else shares its batch: an AR stage's tokens and
final hidden states (which condition the image stage: a text+image request's PNG is only as
reproducible as they are) and a diffusion stage's images. CPU kernels choose algorithms by
shape, so each source of batch dependence is removed where it arises. Measured with torch 2.13
(MKL 2024.2, oneDNN 3.12), fp32, on Intel Sapphire/Emerald Rapids (AVX-512) and on an AMD EPYC
(Zen 3, AVX2 only):

- **MKL GEMMs.** A row of ``F.linear`` depends on the number of rows M in complicated,
  CPU-specific ways (on Intel by default almost every M tried, 2..300, changed the first
  row's last bits). MKL's Conditional Numerical Reproducibility in strict mode,
  ``MKL_CBWR=AUTO,STRICT``, makes every row bit-identical for every M tried on Intel (1..2048,
  K from 64 to 4864, N from 64 to 151936, 1 to 16 threads).
  MKL reads the variable once, at its first GEMM or convolution; ``mkl_cbwr_set`` cannot be
  called instead (MKL's symbols are hidden inside libtorch_cpu.so). So ``import omnistage``
  sets it in the environment (``enable_strict_cnr``): stage processes are spawned, import
  omnistage before torch does any math, and pass the environment on to their children. In
  a process that ran a GEMM before importing omnistage, MKL stays in its default mode.
  On the EPYC strict mode is not enough (nor any CNR branch, nor MKL's default mode): rows
  fall into three classes, M = 1 (MKL's GEMV), M = 2..3 and M >= 4, and a layer with fewer
  than 12 output features per thread splits its rows over the threads, so there a row
  depends on M and on its place up to hundreds of rows. With M >= 4 and at least 12 output
  features per thread, every row was the same for every M tried (4..2048; K 16..4864, N up to
  75968, 1..32 threads). (MKL's other dimension behaves alike: below 12 frames per thread the
  Whisper extractor's mel filter GEMM rounds its frames otherwise, so
  ``qwen2_5_omni/inputs.py`` extracts at least that many.) So every stage process
  (``ArenaWorker``) puts ``omnistage/models/invariant_linear.py``'s ``linear`` in place of
  ``F.linear`` where a probe at start (``aten_rows_vary``: a few GEMMs, ~2 ms) finds ATen's
  rows varying with the batch on its CPU: it pads fewer than 4 rows with zero rows and a
  narrower layer with zero output features; every ``nn.Linear`` uses it, transformers' and
  diffusers' included. A CPU whose rows do not vary (Intel's, under strict mode, by the
  measurements above) keeps ATen's ``F.linear`` and its speed.
  Cost: on Intel, strict mode made single-row GEMMs about twice as long (one row through an
  LM-head-sized 896 x 151936 GEMM: 66 ms instead of 34 ms on one thread, 35 ms instead of
  17 ms on two; GEMMs of two or more rows ran about as fast as before, and no other CNR
  branch was faster); decoding the tiny demo model, 32 sequences at once ran 1-7% slower,
  one sequence alone 22% slower. On the EPYC a padded row costs what 4 rows cost, about 3x a
  GEMV, which reads the weights once where every M >= 4 kernel also packs them (the
  896 x 151936 head: 35.5 ms for one row, 112 ms for 4, strict or not; 896 x 4864: 1.0 and
  2.9 ms; one thread). CPU time per step on one thread (wall times on the shared 2-core
  machine were too noisy): decoding the demo model, one sequence alone 3.7 -> 6.2 ms, 32
  sequences 11.6 -> 11.5 ms; one denoising step of the tiny image preset 6.8 -> 7.3 ms (one
  request, unguided), 9.5 -> 10.2 ms (guided), 26.2 -> 27.2 ms (four guided). (A torch
  function mode routing ``F.linear`` the same way during each step cost more: 7.6 and
  13.7 ms a decode step, every op passing through Python.) ``OMNISTAGE_BATCH_INVARIANT=0``
  (or any ``MKL_CBWR`` of the user's own, which is left alone) keeps MKL's default mode,
  ATen's ``F.linear`` and that speed, and gives up bit-identity.
- **Other GEMMs** (probed on the EPYC). ``bmm``/``baddbmm``/batched ``matmul``: the number of
  matrices never changed one's result (1..16), rows within a matrix did (M = 1..3 against
  M >= 4); SDPA the same: the batch size does not matter, the query rows do (1, 2..3, >= 4).
  Only per-request shapes reach them here (prefill attends per sequence, decode with one
  query row, an image's tokens), so they are left as they are.
- **AR decode attention** (the ``torch_sdpa`` backend, ``omnistage/models/attention.py``). The
  CPU SDPA kernel splits keys into 512-slot chunks and its sums change with the length of the
  last chunk, masked slots included; a batch padded to its widest block table changed a
  1000-token sequence's result. On the CPU each sequence attends over exactly its own blocks
  (sequences with as many blocks share a call); prefill already attends per sequence.
- **silu** (``omnistage/models/decoder.py``). ATen splits elementwise ops into one chunk per
  thread whose last partial SIMD step takes the scalar function; silu's scalar ``std::exp``
  rounds differently from the SIMD one, and where chunks end depends on the number of
  tokens. The MLP pads its silu rows so that every chunk is whole SIMD steps (``rowwise``).
  (cos, sin and exp take the SIMD path for every element already; RMSNorm reduces each row
  on one thread in a fixed order; embedding, rotary, residual and masking arithmetic are
  exact elementwise ops.)
- **Diffusion** (``omnistage/stage/diffusion/batch_invariance.py``): oneDNN convolutions
  round per batch size (batch 1 against 2+ on the EPYC), strict CNR or not, and without
  oneDNN NNPACK takes stride-1 convolutions of 16+ samples, so the denoiser runs with both
  off; the VAE decodes one image at a time. Vocoders decode one utterance at a time.

Not covered: CUDA (cuBLAS and cuDNN choose kernels by shape; expect agreement to about 1e-6);
bf16/fp16 on the CPU (their GEMMs and fp16 attention go through oneDNN, whose row invariance
was not measured); preemption (a recomputed prefill covers prompt and output tokens at once);
elementwise ops with silu's scalar tail inside library modules (on the EPYC gelu with tanh,
softplus, elu and mish round by where a thread's chunk ends, as silu does).
"""

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
