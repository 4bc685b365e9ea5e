#!/usr/bin/env bash
# One-shot GPU validation on the offline GPU machine (one H200, python3 3.12 with torch and
# cuda-bindings, no network). First, on a machine with package access, run
# scripts/gpu-wheels.sh: it puts the wheels that machine lacks into .whl/. Carry .whl with the
# checkout, then there run:   bash scripts/gpu-check.sh
#
# It installs the carried wheels (no index, no dependencies) into a temporary folder, puts the
# checkout and that folder on PYTHONPATH (no venv, no editable install), records versions and
# nvidia-smi, then runs the GPU-marked tests, the arena benchmark and the control benchmark on
# $DEVICE, each under its own timeout, 8 minutes in all. It uses no network.
#
# Writes at most 8 small files into $OUT: summary.md (status of each part and the tables),
# setup.log, gpu-tests.log, bench.log, and the benchmarks' arena-<dev>.{json,md} and
# control-<dev>.{json,md}. Exits 0 when every part passed.
#
# Settings (environment):
#   DEVICE   cuda:0    'cpu' makes a quick dry run (the GPU tests skip, small benchmarks)
#   OUT      gpu-results
#   WHEELS   .whl      folder of wheels to install; missing or empty: install step skipped
#   PYTHON   python3
#   ARENA_SIZES, ARENA_REPEATS   arena benchmark sizes (MiB, comma-separated) and cycles
#                                (cpu: 16 and 1; cuda: 256,1024,4096 and 3)
#   CONTROL_PIPELINES, CONTROL_REPEATS   control benchmark pipelines (comma-separated) and
#                                cycles (cpu: tiny-chat and 1; cuda: tiny-chat,bench and 3)
#
# What the benchmarks report on CUDA (see docs/benchmarks.md, "GPU"): the arena's level-1
# sleep and wake GB/s against a synchronized device -> pinned-host and pinned-host -> device
# copy of the same bytes, level-2 release/remap times, device memory freed
# (torch.cuda.mem_get_info); per pipeline and level, sleep/wake latency, first token after
# wake, freed memory from the sleep ACK, cuda_graph_recalled from the wake ACK, and whether
# a greedy decode gives the same tokens before the sleep and after the wake.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
ROOT="$PWD"
DEVICE="${DEVICE:-cuda:0}"
OUT="${OUT:-gpu-results}"
WHEELS="${WHEELS:-.whl}"
PYTHON="${PYTHON:-python3}"
if [[ "$DEVICE" == cpu ]]; then # a dry run: small and quick
  ARENA_SIZES="${ARENA_SIZES:-16}" ARENA_REPEATS="${ARENA_REPEATS:-1}"
  CONTROL_PIPELINES="${CONTROL_PIPELINES:-tiny-chat}" CONTROL_REPEATS="${CONTROL_REPEATS:-1}"
else
  ARENA_SIZES="${ARENA_SIZES:-256,1024,4096}" ARENA_REPEATS="${ARENA_REPEATS:-3}"
  CONTROL_PIPELINES="${CONTROL_PIPELINES:-tiny-chat,bench}" CONTROL_REPEATS="${CONTROL_REPEATS:-3}"
fi
TAG="${DEVICE//:/}" # the benchmarks name their files <bench>-<device without ':'>

# Time limits in seconds. Each part has its own, so one hang cannot eat the rest, and each is
# also cut to what is left of TOTAL_S, so the whole run ends within 8 minutes (the control
# benchmark, last, gets what is left up to its own limit); GRACE_S: from SIGTERM to SIGKILL.
TOTAL_S=480 GRACE_S=3
T_INSTALL=45 T_VERSIONS=60 T_SMI=15 T_TESTS=130 T_ARENA=90 T_CONTROL=240
deadline=$((SECONDS + TOTAL_S))

# Offline: nothing below may reach a package index or a model hub.
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
# Built-in tiny models are built on first use; share them between tests and benchmarks.
export OMNISTAGE_CACHE_DIR="${OMNISTAGE_CACHE_DIR:-$ROOT/.omnistage-cache/models}"

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
SUMMARY="$OUT/summary.md" SETUP="$OUT/setup.log" TESTS="$OUT/gpu-tests.log" BENCH="$OUT/bench.log"
rm -f "$SUMMARY" "$SETUP" "$TESTS" "$BENCH" "$OUT/arena-$TAG".{json,md} "$OUT/control-$TAG".{json,md}

SITE=""
trap 'if [[ -n "$SITE" ]]; then rm -rf "$SITE"; fi' EXIT

failed=()
{
  echo "# GPU check: DEVICE=$DEVICE"
  echo
  echo "$(date -u +%Y-%m-%dT%H:%M:%SZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)," \
    "wheels: $WHEELS"
  echo
  echo "| part | rc | seconds | limit_s |"
  echo "|---|---|---|---|"
} >"$SUMMARY"

# part NAME LIMIT_S LOG CMD...: run CMD under timeout (cut to the time left), log its output,
# add a row to the summary; a non-zero rc marks the run failed. 124/137 mean timed out.
part() {
  local name="$1" limit="$2" log="$3" left start rc cmd
  shift 3
  left=$((deadline - SECONDS - GRACE_S))
  ((left < limit)) && limit=$left
  if ((limit < 5)); then
    echo "| $name | not run: out of time | 0 | 0 |" >>"$SUMMARY"
    failed+=("$name")
    return 1
  fi
  start=$SECONDS
  cmd="$*"
  printf '$ %.200s\n' "${cmd//$'\n'/ }" >>"$log"
  timeout -k "$GRACE_S" "$limit" "$@" >>"$log" 2>&1
  rc=$?
  if ((rc == 124 || rc == 137)); then echo "TIMED OUT after ${limit}s" >>"$log"; fi
  echo "rc=$rc" >>"$log"
  echo "| $name | $rc | $((SECONDS - start)) | $limit |" >>"$SUMMARY"
  ((rc == 0)) || failed+=("$name")
  return "$rc"
}

# The pinned list, parsed out of scripts/gpu-wheels.sh (one name==version a line).
mapfile -t PINS < <(sed -n '/^PACKAGES=(/,/^)/p' scripts/gpu-wheels.sh 2>/dev/null |
  grep -oE '^[[:space:]]*[A-Za-z0-9_.-]+==[^[:space:]#]+' | tr -d ' \t')

# 1. Install the carried wheels into a temporary site folder.
shopt -s nullglob
wheels=("$WHEELS"/*.whl)
shopt -u nullglob
if ((${#wheels[@]} == 0)); then
  echo "no wheels in '$WHEELS': install step skipped, using the packages $PYTHON already has" |
    tee -a "$SETUP"
  echo "| install | skipped: no wheels in $WHEELS | 0 | 0 |" >>"$SUMMARY"
else
  SITE="$(mktemp -d "${TMPDIR:-/tmp}/gpu-site.XXXXXX")"
  echo "installing ${#wheels[@]} wheels from $WHEELS into $SITE" >>"$SETUP"
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    part install "$T_INSTALL" "$SETUP" "$PYTHON" -m pip install -q --no-index --no-deps \
      --no-compile --target "$SITE" "${wheels[@]}"
  else # no pip: a wheel is a zip archive that unpacks into site-packages as it is
    part install "$T_INSTALL" "$SETUP" "$PYTHON" -c \
      'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' \
      "$SITE" "${wheels[@]}"
  fi
fi
export PYTHONPATH="$ROOT${SITE:+:$SITE}${PYTHONPATH:+:$PYTHONPATH}"
echo "PYTHONPATH=$PYTHONPATH" >>"$SETUP"

# 2. Versions and imports: python, torch, CUDA, each pinned package (and where it came from).
# shellcheck disable=SC2016 # the Python below is not for bash to expand
VERSIONS_PY='
import importlib, importlib.metadata as md, platform, sys
print("python", platform.python_version(), sys.executable)
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "cuda available", torch.cuda.is_available())
if torch.cuda.is_available():
    free, total = torch.cuda.mem_get_info()
    print("device", torch.cuda.get_device_name(0), f"free {free / 2**30:.1f} / {total / 2**30:.1f} GiB")
def show(name, pin=None):
    try:
        dist = md.distribution(name)
        version, where = dist.version, str(dist.locate_file(""))
    except md.PackageNotFoundError:
        version, where = "MISSING", ""
    note = f"  <-- pinned {pin}" if pin and version != pin else ""
    print(f"  {name:22} {version:14} {where}{note}")
print("pinned (scripts/gpu-wheels.sh):")
for spec in sys.argv[1:]:
    show(*spec.split("=="))
print("present on the machine:")
for name in ("torch", "cuda-bindings", "transformers", "huggingface-hub", "safetensors",
             "tokenizers", "numpy", "pyyaml", "httpx", "psutil", "prometheus-client",
             "jinja2", "pillow", "pytest"):
    show(name)
bad = []
for mod in ("omnistage.cli", "omnistage.entrypoints.openai.api_server", "fastapi", "uvicorn",
            "zmq", "msgspec", "diffusers", "openai", "pytest_asyncio", "pytest_timeout"):
    try:
        importlib.import_module(mod)
    except Exception as exc:
        bad.append(mod)
        print(f"import {mod} failed: {type(exc).__name__}: {exc}")
print("imports:", "FAILED " + " ".join(bad) if bad else "ok")
sys.exit(1 if bad else 0)
'
part versions "$T_VERSIONS" "$SETUP" "$PYTHON" -c "$VERSIONS_PY" "${PINS[@]}"

# nvidia-smi is for the record only (absent on a CPU dry run).
if command -v nvidia-smi >/dev/null 2>&1; then
  timeout -k "$GRACE_S" "$T_SMI" nvidia-smi >>"$SETUP" 2>&1 || echo "nvidia-smi rc=$?" >>"$SETUP"
else
  echo "nvidia-smi: not found" >>"$SETUP"
fi

# 3. The GPU-marked tests (they skip cleanly without CUDA). They live in files named *_gpu.py
# (tests/e2e/test_gpu_kit.py checks it), so only those are collected, not the whole suite.
mapfile -t GPU_TESTS < <(find tests -name '*_gpu.py' | sort)
part gpu-tests "$T_TESTS" "$TESTS" "$PYTHON" -m pytest -q -p no:cacheprovider -m gpu \
  "${GPU_TESTS[@]}" -rs

# 4. Benchmarks on the device; each writes <name>-<dev>.json and .md into $OUT, rewritten after
# every arena size and control pipeline, so a part cut short by its timeout keeps what it did.
part bench-arena "$T_ARENA" "$BENCH" "$PYTHON" -m omnistage.cli bench arena --device "$DEVICE" \
  --out "$OUT" --sizes-mib "$ARENA_SIZES" --repeats "$ARENA_REPEATS"
part bench-control "$T_CONTROL" "$BENCH" "$PYTHON" -m omnistage.cli bench control --device "$DEVICE" \
  --out "$OUT" --pipelines "$CONTROL_PIPELINES" --repeats "$CONTROL_REPEATS"

{
  echo
  echo "## GPU tests"
  echo
  echo '```'
  grep -E '^(SKIPPED|FAILED|ERROR)|passed|failed|skipped|TIMED OUT' "$TESTS" | tail -n 20
  echo '```'
  for name in "arena-$TAG" "control-$TAG"; do
    echo
    echo "## $name"
    echo
    cat "$OUT/$name.md" 2>/dev/null || echo "(no table: see bench.log)"
  done
  echo
  if ((${#failed[@]})); then echo "result: FAILED (${failed[*]})"; else echo "result: passed"; fi
} >>"$SUMMARY"
cat "$SUMMARY"
echo "files in $OUT:"
ls -l "$OUT"
if ((${#failed[@]})); then exit 1; fi
exit 0
