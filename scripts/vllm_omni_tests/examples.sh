#!/usr/bin/env bash
# Run vLLM-Omni's multimodal example client and curl script, unmodified, against omnistage
# servers of the tiny omni pipelines, in every mode they offer, with local media.
#
#   scripts/vllm_omni_tests/examples.sh CHECKOUT [MEDIA_DIR]
#
# CHECKOUT: a vLLM-Omni checkout. MEDIA_DIR: a folder with image.jpg, audio.wav and video.mp4
# (a video with an audio track); made here with PyAV, soundfile and Pillow when not given.
# For each of Qwen/Qwen2.5-Omni-7B (tiny-qwen2.5-omni) and Qwen/Qwen3-Omni-30B-A3B-Instruct
# (tiny-qwen3-omni) it runs examples/online_serving/openai_chat_completion_client_for_
# multimodal_generation.py with each query type and output mode, and the family's
# run_curl_multimodal_generation.sh for a text query, and prints one line per case: PASS when
# the client printed text or saved audio as the mode asks, FAIL with the end of its output
# otherwise. The servers listen on localhost:$PORT (8091, where the curl scripts send). The
# client's remote defaults (use_multi_audios fetches two URLs) are left out:
# nothing here reaches the network. Uses the runner's virtualenv (run.sh makes it) and its
# stubs for the client's vllm imports. Exit status: the number of failed cases.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$HERE/../.." && pwd)"
if [[ $# -lt 1 || "$1" == "-h" || "$1" == "--help" ]]; then
    awk 'NR > 1 && /^#/ { sub(/^# ?/, ""); print; next } NR > 1 { exit }' "$0"
    exit 2
fi
CHECKOUT="$(cd "$1" && pwd)"
VENV="${VLLM_OMNI_TESTS_VENV:-$ROOT/.venv-vllm-omni-tests}"
PY="$VENV/bin/python"
OMNISTAGE="${OMNISTAGE_BIN:-$ROOT/.venv/bin/omnistage}"
[[ -x "$PY" ]] || { echo "error: no $PY: run scripts/vllm_omni_tests/run.sh once first" >&2; exit 2; }
CLIENT="$CHECKOUT/examples/online_serving/openai_chat_completion_client_for_multimodal_generation.py"
WORK="$(mktemp -d)"
trap 'kill "${SERVER:-0}" 2>/dev/null; rm -rf "$WORK"' EXIT

MEDIA="${2:-$WORK/media}"
if [[ $# -lt 2 ]]; then
    mkdir -p "$MEDIA"
    "$PY" - "$MEDIA" <<'EOF'
import sys, numpy as np, soundfile as sf, av
from PIL import Image
out = sys.argv[1]
Image.fromarray((np.indices((96, 128)).sum(0) % 255).astype(np.uint8)).convert("RGB").save(f"{out}/image.jpg")
t = np.arange(32000) / 16000
sf.write(f"{out}/audio.wav", (0.3 * np.sin(2 * np.pi * 440 * t)).astype(np.float32), 16000)
with av.open(f"{out}/video.mp4", "w") as c:
    v = c.add_stream("mpeg4", rate=8); v.width, v.height, v.pix_fmt = 128, 96, "yuv420p"
    a = c.add_stream("aac", rate=16000)
    for i in range(16):
        frame = np.full((96, 128, 3), i * 15, np.uint8)
        c.mux(v.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
    samples = (0.3 * np.sin(2 * np.pi * 440 * np.arange(32000) / 16000)).astype(np.float32)
    frame = av.AudioFrame.from_ndarray(samples[None], format="fltp", layout="mono")
    frame.sample_rate = 16000
    c.mux(a.encode(frame)); c.mux(a.encode()); c.mux(v.encode())
EOF
fi
IMAGE="$MEDIA/image.jpg" AUDIO="$MEDIA/audio.wav" VIDEO="$MEDIA/video.mp4"
export VLLM_OMNI_CHECKOUT="$CHECKOUT" # the stubbed package root finds the checkout's modules
export PYTHONPATH="$HERE/stubs:$CHECKOUT${PYTHONPATH:+:$PYTHONPATH}"

failed=0
PORT="${PORT:-8091}" # the curl scripts ask localhost:8091
serve() { # PIPELINE NAME: a server on $PORT, ready
    "$OMNISTAGE" serve --pipeline "$1" --served-model-name "$2" --host localhost --port "$PORT" \
        >"$WORK/server-$1.log" 2>&1 &
    SERVER=$!
    for _ in $(seq 600); do
        curl -sf "http://localhost:$PORT/health" >/dev/null && return 0
        sleep 0.5
    done
    echo "error: $1 did not come up; see its log:" >&2; tail -20 "$WORK/server-$1.log" >&2
    return 1
}
check() { # NAME EXPECT(text|audio|both) CMD...: run, judge by what the client printed
    local name="$1" expect="$2" out="$WORK/out.txt"
    shift 2
    (cd "$WORK" && timeout 600 "$@") >"$out" 2>&1
    local rc=$? text=0 audio=0
    grep -qE 'Chat completion output from text: .|^content:.|^Output of request: "' "$out" && text=1
    grep -q "Audio saved to" "$out" && audio=1
    local ok=0
    case "$expect" in
        text) ((text && !audio)) && ok=1 ;;
        audio) ((audio)) && ok=1 ;;
        both) ((text && audio)) && ok=1 ;;
    esac
    if ((rc == 0 && ok)); then
        echo "PASS  $name"
    else
        echo "FAIL  $name (rc=$rc, text=$text, audio=$audio)"; tail -5 "$out" | sed 's/^/      /'
        failed=$((failed + 1))
    fi
}

for pair in "tiny-qwen2.5-omni Qwen/Qwen2.5-Omni-7B qwen2_5_omni" \
            "tiny-qwen3-omni Qwen/Qwen3-Omni-30B-A3B-Instruct qwen3_omni"; do
    read -r pipeline model family <<<"$pair"
    echo "== $model served by omnistage's $pipeline"
    serve "$pipeline" "$model" || { failed=$((failed + 1)); continue; }
    c=("$PY" "$CLIENT" --model "$model" --host localhost --port "$PORT")
    check "$family text, text out" text "${c[@]}" -q text --modalities text
    check "$family text, audio out" audio "${c[@]}" -q text --modalities audio
    check "$family text, text and audio (default)" both "${c[@]}" -q text
    check "$family text, streamed" both "${c[@]}" -q text --stream
    check "$family audio in" both "${c[@]}" -q use_audio -a "$AUDIO"
    check "$family image in" both "${c[@]}" -q use_image -i "$IMAGE"
    check "$family video in" both "${c[@]}" -q use_video -v "$VIDEO"
    check "$family mixed: audio, image, video" both "${c[@]}" -q use_mixed_modalities \
        -a "$AUDIO" -i "$IMAGE" -v "$VIDEO"
    check "$family audio in video" both "${c[@]}" -q use_audio_in_video -v "$VIDEO"
    check "$family image in, streamed" both "${c[@]}" -q use_image -i "$IMAGE" --stream
    check "$family 3 concurrent" both "${c[@]}" -q text --num-concurrent-requests 3
    check "$family speaker Ethan" both "${c[@]}" -q text --speaker Ethan
    check "$family curl script, text" text \
        bash "$CHECKOUT/examples/online_serving/$family/run_curl_multimodal_generation.sh" text
    kill "$SERVER"; wait "$SERVER" 2>/dev/null
done
echo "== $failed failed"
exit "$failed"
