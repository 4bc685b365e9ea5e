#!/usr/bin/env bash
# Run HERE (a machine with package access) before a GPU run: downloads the cp312 manylinux
# x86-64 wheels of exactly the packages the offline GPU machine lacks into $WHEELS (default
# .whl, git-ignored), one version each, no dependencies resolved by pip, and prints their
# total size. Carry that folder with the checkout (64 MiB in all, checkout included) and run
# scripts/gpu-check.sh there; it installs these wheels with --no-index into a temporary dir.
#
# The GPU machine (python3 3.12, no network) already has: torch (CUDA), cuda-bindings,
# transformers, safetensors, tokenizers, pyyaml, httpx, psutil, prometheus-client, jinja2,
# pillow, pytest. Assumed present there, because they came with those (so NOT carried):
#   torch:        filelock, fsspec, sympy, networkx, setuptools (typing-extensions: see below)
#   transformers: numpy, huggingface-hub (diffusers wants >=1.32), regex, tqdm, packaging,
#                 safetensors (diffusers wants >=0.8)
#   httpx:        certifi (also wanted by requests), httpcore
#   pytest:       iniconfig, pluggy (pytest-asyncio 1.5 wants pytest>=8.4)
#   pillow, jinja2 (markupsafe): named above.
# Carried although some copy may be there already, because the versions the packages below
# need are recent and the ones on that machine are unknown (the carried copy comes first on
# PYTHONPATH, and is the version the project's tests run with): typing-extensions (pydantic,
# pydantic-core and anyio want >=4.16), anyio (httpx has one; openai wants >=4.10), idna
# (httpx2 wants >=3.18), h11 (httpcore has one), click (huggingface-hub may have one).
# requests (+ urllib3, charset-normalizer) is carried for diffusers, which checks at import
# that it is installed; transformers 5 no longer depends on it, so it may well be missing.
# Not carried: distro (openai 3.x no longer depends on it), exceptiongroup and
# backports-asyncio-runner (only for Python < 3.11).
#
# Versions are pinned to what the tests use (the .venv); tests/e2e/test_gpu_kit.py checks
# that every pin below equals the version installed in the venv that runs the tests.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
WHEELS="${WHEELS:-.whl}"
PYTHON="${PYTHON:-python3}" # the interpreter whose pip downloads (any version)
# The GPU machine's Python; another version only to rehearse the kit on a machine like this.
PYTHON_VERSION="${PYTHON_VERSION:-3.12}"
LIMIT_MIB=64

# One `name==version` a line (parsed by tests/e2e/test_gpu_kit.py and scripts/gpu-check.sh).
PACKAGES=(
  # missing on the GPU machine
  pydantic==2.14.4
  pydantic-core==2.50.5
  fastapi==0.165.0
  starlette==1.10.0
  uvicorn==0.54.0
  pyzmq==27.3.0
  msgspec==0.23.0
  setproctitle==1.3.8
  diffusers==0.42.1
  openai==3.57.0
  pytest-asyncio==1.5.0
  pytest-timeout==2.4.0
  # their runtime dependencies (Requires-Dist), which the GPU machine lacks or may have too old
  annotated-types==0.8.0
  typing-inspection==0.4.5
  typing-extensions==4.16.0
  annotated-doc==0.0.7
  opentelemetry-api==1.45.2
  anyio==4.16.0
  sniffio==1.3.1
  idna==3.20
  h11==0.16.0
  click==8.5.1
  importlib-metadata==10.2.0
  zipp==4.1.2
  lazy-importer==0.1.0
  requests==2.34.2
  urllib3==2.8.0
  charset-normalizer==3.5.3
  httpx2==2.16.2
  httpcore2==2.16.2
  truststore==0.10.5
  jiter==0.19.0
)

PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64)
# Tried only for a package with no wheel for the platforms above; all need glibc <= 2.28,
# which the GPU machine has (its torch build needs it).
MORE_PLATFORMS=(manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64
  manylinux2010_x86_64 manylinux1_x86_64)

download() { # download DEST SPEC... PLATFORM... (a platform: an argument starting manylinux)
  local dest="$1"
  shift
  local args=() specs=() a
  for a in "$@"; do
    if [[ "$a" == manylinux* ]]; then args+=(--platform "$a"); else specs+=("$a"); fi
  done
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version "$PYTHON_VERSION" --implementation cp "${args[@]}" -d "$dest" "${specs[@]}"
}

# Download into a fresh folder and swap it in only when complete, so the folder never holds
# two versions of one package or a partial set.
tmp="$(mktemp -d "${TMPDIR:-/tmp}/gpu-wheels.XXXXXX")"
trap 'rm -rf "$tmp"' EXIT
# One pip for the whole list (each pip takes about a second to start); only when that fails,
# a package at a time, with the older platforms for those that still fail.
failed=()
if ! download "$tmp" "${PACKAGES[@]}" "${PLATFORMS[@]}" 2>/dev/null; then
  rm -f "$tmp"/*.whl
  for spec in "${PACKAGES[@]}"; do
    if ! download "$tmp" "$spec" "${PLATFORMS[@]}"; then
      echo "retrying $spec with older manylinux platforms" >&2
      download "$tmp" "$spec" "${PLATFORMS[@]}" "${MORE_PLATFORMS[@]}" || failed+=("$spec")
    fi
  done
fi
if ((${#failed[@]})); then
  echo "no cp312 manylinux x86-64 wheel for: ${failed[*]}" >&2
  exit 1
fi

count="$(find "$tmp" -maxdepth 1 -name '*.whl' | wc -l)"
if [[ "$count" -ne "${#PACKAGES[@]}" ]]; then
  echo "expected ${#PACKAGES[@]} wheels, got $count:" >&2
  ls "$tmp" >&2
  exit 1
fi
rm -rf "$WHEELS"
mkdir -p "$(dirname "$WHEELS")"
mv "$tmp" "$WHEELS"
chmod 755 "$WHEELS"
trap - EXIT

bytes="$(find "$WHEELS" -maxdepth 1 -name '*.whl' -printf '%s\n' | awk '{s += $1} END {print s + 0}')"
mib="$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')"
checkout="$(git ls-files -z 2>/dev/null | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f 1)"
checkout_mib="$(awk -v b="${checkout:-0}" 'BEGIN {printf "%.1f", b / 1048576}')"
ls -l "$WHEELS"
echo "$count wheels in $WHEELS: $bytes bytes ($mib MiB); tracked checkout: $checkout_mib MiB;" \
  "limit for both together: $LIMIT_MIB MiB"
if ((bytes + ${checkout:-0} > LIMIT_MIB * 1048576)); then
  echo "too large to carry to the GPU machine" >&2
  exit 1
fi
