#!/usr/bin/env bash
# One-shot GPU validation for a session that is lent a CUDA machine: runs the GPU-only tests
# and the benchmarks on cuda:0, writing everything under $OUT (default ./gpu-results).
# Expected wall time on one H200: ~5 minutes including the install.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
{
  nvidia-smi || true
  python3 -m venv .venv-gpu && . .venv-gpu/bin/activate
  pip install -q -e ".[dev,gpu]"
  python -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"
} >"$OUT/setup.log" 2>&1
. .venv-gpu/bin/activate
timeout 400 python -m pytest -q -p no:cacheprovider -m gpu tests -rs >"$OUT/gpu-tests.log" 2>&1
echo "gpu tests rc=$?" >>"$OUT/gpu-tests.log"
timeout 300 python -m omnistage.cli bench arena --device cuda:0 --out "$OUT/bench" >"$OUT/bench.log" 2>&1
timeout 300 python -m omnistage.cli bench control --device cuda:0 --out "$OUT/bench" >>"$OUT/bench.log" 2>&1
echo "done; see $OUT"
