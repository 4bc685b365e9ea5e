#!/usr/bin/env bash
# Run vLLM-Omni's own online-serving tests, unmodified, against omnistage servers on 127.0.0.1.
#
#   scripts/vllm_omni_tests/run.sh VLLM_OMNI_CHECKOUT [pytest args...]
#
# With no pytest args it runs the default selection below at --run-level core_model. Any args
# given replace the selection (paths are relative to the checkout), e.g.
#   run.sh /src/vllm-omni tests/e2e/online_serving/test_wan22_t2v.py -x
#   run.sh /src/vllm-omni --run-level advanced_model tests/e2e/online_serving/test_qwen_image.py
#
# Environment:
#   VLLM_OMNI_TESTS_VENV      the runner's own virtualenv (default: <omnistage>/.venv-vllm-omni-tests)
#   OMNISTAGE_BIN             omnistage CLI (default: <omnistage>/.venv/bin/omnistage)
#   OMNISTAGE_REV             serve omnistage as of this commit (e.g. HEAD) instead of the
#                             working tree; OMNISTAGE_SRC=DIR serves the source in DIR
#   VLLM_OMNI_TESTS_LOG_DIR   server logs (default: a fresh temp dir, printed at start)
#   VLLM_OMNI_TESTS_TIMEOUT   per-test timeout in seconds (default 900)
#   VLLM_OMNI_TESTS_TORCH_INDEX  a CPU-only package index for torch where PyPI's default is CUDA
#   VLLM_OMNI_TESTS_NO_APT=1  never apt-get install espeak-ng (pyttsx3's speech engine)
#   VLLM_OMNI_TESTS_REAL_WHISPER=1  install openai-whisper and use it instead of the stub
#                             (needs network access to its weights at run time)
# See README.md beside this file.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OMNISTAGE_ROOT="$(cd "$HERE/../.." && pwd)"

if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 2
fi
CHECKOUT="$(cd "$1" && pwd)"
shift
if [[ ! -f "$CHECKOUT/tests/helpers/runtime.py" || ! -d "$CHECKOUT/vllm_omni" ]]; then
    echo "error: $CHECKOUT is not a vLLM-Omni checkout (no tests/helpers/runtime.py)" >&2
    exit 2
fi

VENV="${VLLM_OMNI_TESTS_VENV:-$OMNISTAGE_ROOT/.venv-vllm-omni-tests}"
OMNISTAGE_BIN="${OMNISTAGE_BIN:-$OMNISTAGE_ROOT/.venv/bin/omnistage}"
if [[ ! -x "$OMNISTAGE_BIN" ]]; then
    echo "error: omnistage CLI not found at $OMNISTAGE_BIN (run 'make install' in $OMNISTAGE_ROOT, or set OMNISTAGE_BIN)" >&2
    exit 2
fi

# OMNISTAGE_REV=<commit|HEAD>: serve omnistage's code as of that commit (a `git archive` of its
# omnistage/ folder, imported ahead of the editable install through PYTHONPATH) instead of the
# working tree, which may be mid-edit.
if [[ -n "${OMNISTAGE_REV:-}" ]]; then
    SHA="$(git -C "$OMNISTAGE_ROOT" rev-parse --verify "${OMNISTAGE_REV}^{commit}")"
    OMNISTAGE_SRC="${TMPDIR:-/tmp}/omnistage-src-${SHA:0:12}"
    if [[ ! -f "$OMNISTAGE_SRC/omnistage/__init__.py" ]]; then
        rm -rf "$OMNISTAGE_SRC.tmp" && mkdir -p "$OMNISTAGE_SRC.tmp"
        git -C "$OMNISTAGE_ROOT" archive "$SHA" omnistage | tar -x -C "$OMNISTAGE_SRC.tmp"
        rm -rf "$OMNISTAGE_SRC" && mv "$OMNISTAGE_SRC.tmp" "$OMNISTAGE_SRC"
    fi
    export OMNISTAGE_SRC
    echo "== omnistage source: commit ${SHA:0:12} ($OMNISTAGE_SRC)"
elif [[ -n "${OMNISTAGE_SRC:-}" ]]; then
    export OMNISTAGE_SRC
    echo "== omnistage source: $OMNISTAGE_SRC"
else
    echo "== omnistage source: the working tree $OMNISTAGE_ROOT"
fi

# --- the runner's virtualenv (created once; re-checked when this script's package list changes)
PACKAGES=(
    pytest pytest-asyncio pytest-mock pytest-timeout
    openai requests psutil pyyaml numpy pillow soundfile av opencv-python-headless
    imageio imageio-ffmpeg mistune safetensors cloudpickle
    # tests/helpers/tiny_model.py (imported through runtime.py) imports diffusers and transformers
    diffusers transformers
    # media helpers: synthetic speech (pyttsx3 drives espeak-ng) and Chinese text normalisation
    pyttsx3 opencc
)
# torch: tests/helpers/fixtures/env.py (loaded by tests/conftest.py) and tests/examples/helpers.py
# import it at module level; nothing runs a model on it, so the CPU build is all that is needed.
# On this machine "torch==2.13.0" resolves to a local CPU wheel; elsewhere point
# VLLM_OMNI_TESTS_TORCH_INDEX at a CPU index (e.g. https://download.pytorch.org/whl/cpu).
TORCH_SPEC="${VLLM_OMNI_TESTS_TORCH:-torch==2.13.0}"
TORCH_INDEX_ARGS=()
[[ -n "${VLLM_OMNI_TESTS_TORCH_INDEX:-}" ]] && TORCH_INDEX_ARGS=(--index-url "$VLLM_OMNI_TESTS_TORCH_INDEX")
STAMP="$VENV/.omnistage-runner-$(printf '%s\n' "${PACKAGES[@]}" "$TORCH_SPEC" "${VLLM_OMNI_TESTS_REAL_WHISPER:-0}" | sha1sum | cut -c1-12)"
if [[ ! -f "$STAMP" ]]; then
    echo "== setting up $VENV"
    [[ -x "$VENV/bin/python" ]] || python3 -m venv "$VENV"
    "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
    if ! "$VENV/bin/python" -c 'import torch' 2>/dev/null; then
        # Never let pip pull a CUDA build: look at the wheel it would pick first.
        wheel="$("$VENV/bin/python" -m pip install --dry-run --quiet --no-deps --report - \
            "${TORCH_INDEX_ARGS[@]+"${TORCH_INDEX_ARGS[@]}"}" "$TORCH_SPEC" 2>/dev/null \
            | "$VENV/bin/python" -c 'import json, sys; print(json.load(sys.stdin)["install"][0]["download_info"]["url"])')" || wheel=""
        case "$wheel" in
            *cpu*) ;;
            *)
                echo "error: pip would install '${wheel:-nothing}' for $TORCH_SPEC, not a CPU build of torch." >&2
                echo "       Set VLLM_OMNI_TESTS_TORCH_INDEX=https://download.pytorch.org/whl/cpu (or pre-install a CPU torch into $VENV)." >&2
                exit 1 ;;
        esac
        "$VENV/bin/python" -m pip install -q "${TORCH_INDEX_ARGS[@]+"${TORCH_INDEX_ARGS[@]}"}" "$TORCH_SPEC"
    fi
    "$VENV/bin/python" -m pip install -q "${PACKAGES[@]}"
    if [[ "${VLLM_OMNI_TESTS_REAL_WHISPER:-0}" == "1" ]]; then
        "$VENV/bin/python" -m pip install -q openai-whisper
    fi
    if "$VENV/bin/python" -c 'import torch, sys; sys.exit(0 if torch.version.cuda else 1)'; then
        echo "warning: $VENV has a CUDA build of torch; the tests only need the CPU build" >&2
    fi
    rm -f "$VENV"/.omnistage-runner-*
    touch "$STAMP"
fi

# pyttsx3 speaks through libespeak-ng (tests/helpers/media.generate_synthetic_audio).
if ! ldconfig -p 2>/dev/null | grep -q 'libespeak-ng\.so'; then
    if [[ "${VLLM_OMNI_TESTS_NO_APT:-0}" != "1" && "$(id -u)" == "0" ]] && command -v apt-get >/dev/null; then
        echo "== installing espeak-ng (pyttsx3's speech engine)"
        (apt-get install -y -qq espeak-ng >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq espeak-ng >/dev/null)) \
            || echo "warning: could not install espeak-ng: tests that synthesise speech will fail" >&2
    else
        echo "warning: libespeak-ng not found (apt-get install espeak-ng): tests that synthesise speech will fail" >&2
    fi
fi
for tool in curl jq base64; do
    command -v "$tool" >/dev/null || echo "warning: '$tool' not on PATH: the example tests that pipe through it will fail" >&2
done

DEFAULT_SELECTION=()
for pattern in \
    "tests/e2e/online_serving/test_qwen2_5_omni*.py" \
    "tests/e2e/online_serving/test_qwen3_omni.py" \
    "tests/e2e/online_serving/test_qwen3_omni_expansion.py" \
    "tests/e2e/online_serving/test_qwen_image.py" \
    "tests/e2e/online_serving/test_flux_kontext_expansion.py" \
    "tests/e2e/online_serving/test_flux_1*.py" \
    "tests/e2e/online_serving/test_sd3*.py" \
    "tests/e2e/online_serving/test_wan22_t2v.py" \
    "tests/e2e/online_serving/test_wan22_expansion.py" \
    "tests/e2e/online_serving/test_wan_2_1_vace_expansion.py" \
    "tests/examples/online_serving/test_qwen2_5_omni.py" \
    "tests/examples/online_serving/test_qwen3_omni.py" \
    "tests/examples/online_serving/test_text_to_image.py"; do
    for f in $(cd "$CHECKOUT" && compgen -G "$pattern" || true); do
        DEFAULT_SELECTION+=("$f")
    done
done

ARGS=("$@")
has_selection=0
has_level=0
for a in "${ARGS[@]+"${ARGS[@]}"}"; do
    case "$a" in
        --run-level|--run-level=*) has_level=1 ;;
        tests/*|*.py|*::*) has_selection=1 ;;
    esac
done
[[ $has_selection == 1 ]] || ARGS+=("${DEFAULT_SELECTION[@]}")
[[ $has_level == 1 ]] || ARGS+=(--run-level core_model)

export VLLM_OMNI_CHECKOUT="$CHECKOUT"
export OMNISTAGE_BIN
# `python` must be this venv's (the example tests run "python <client>.py"); omnistage's own venv
# stays off PATH except for its CLI, linked alone into a folder of its own.
mkdir -p "$VENV/omnistage-bin"
ln -sfn "$OMNISTAGE_BIN" "$VENV/omnistage-bin/omnistage"
export PATH="$VENV/bin:$VENV/omnistage-bin:$PATH"
# The plugin and the stubs: for pytest and for the example clients it runs as subprocesses.
export PYTHONPATH="$HERE/stubs:$HERE${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONDONTWRITEBYTECODE=1  # no __pycache__ folders in the checkout
export VLLM_OMNI_TESTS_LOG_DIR="${VLLM_OMNI_TESTS_LOG_DIR:-$(mktemp -d -t omnistage-vllm-omni-logs-XXXXXX)}"

cd "$CHECKOUT"
set -x
exec "$VENV/bin/python" -m pytest -p omnistage_plugin -p no:cacheprovider \
    --timeout "${VLLM_OMNI_TESTS_TIMEOUT:-900}" -v -ra "${ARGS[@]}"
