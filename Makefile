# omnistage — two commands: `make serve` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_CPU_VERSION ?= 2.13.0
HOST ?= 127.0.0.1
PORT ?= 8000
PIPELINE ?= tiny-omni

.PHONY: install serve test test-unit lint bench clean

install: $(VENV)/.installed

# Chromium (Debian's package) for the console's browser test, tests/e2e/test_ui.py, which would
# otherwise install it itself: fetched in the background while pip works, when it is missing
# and this is root with apt-get (elsewhere the test skips, saying why).
APT_GET := DEBIAN_FRONTEND=noninteractive apt-get -q -y -o DPkg::Lock::Timeout=300 --no-install-recommends
CHROMIUM := command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null \
	|| $(APT_GET) install chromium >/dev/null 2>&1 \
	|| { $(APT_GET) update >/dev/null 2>&1 && $(APT_GET) install chromium >/dev/null 2>&1; } || true

$(VENV)/.installed: pyproject.toml Makefile
	( $(CHROMIUM) ) & chromium=$$!; \
	test -x $(BIN)/python || $(PY) -m venv $(VENV); \
	$(BIN)/python -m pip install -q --upgrade pip \
	&& if ! command -v nvidia-smi >/dev/null 2>&1; then \
		$(BIN)/python -m pip install -q "torch==$(TORCH_CPU_VERSION)"; \
	fi \
	&& $(BIN)/python -m pip install -q -e ".[dev]" \
	&& $(BIN)/python -m pip install -q --no-deps "trl==1.16.*" "qwen-tts-hf==0.1.1.post1"; \
	status=$$?; wait $$chromium; exit $$status
	@# Without an NVIDIA driver the CPU build of torch is taken first (a bare `torch` requirement
	@# would otherwise pull a multi-GB CUDA build). TRL's own vLLM client (what GRPOTrainer uses
	@# in server mode), driven against `omnistage serve` by tests/e2e/test_trl_client.py, needs
	@# torch, transformers and requests only; trl's training dependencies (datasets, pandas,
	@# pyarrow, accelerate) would add a minute to every set-up. The official qwen-tts package
	@# (qwen-tts-hf, its build for transformers 5) is the Qwen3-TTS tests' reference, without
	@# its dependencies (librosa, torchaudio, sox, onnxruntime, gradio): tests/qwen3_tts_reference.py
	@# stubs those the 12 Hz paths never call.
	touch $@

serve: install
	$(BIN)/omnistage serve --pipeline $(PIPELINE) --enable-sleep-mode --host $(HOST) --port $(PORT)

# The Ray tests run in a pytest process of their own, so that a Ray teardown problem cannot
# end the whole run without a report (one did: a stage handle's watcher thread still asking
# Ray while the driver shut Ray down; the handle now joins it).
#
# Two pytest runs at once, on the two cores CI has: the main one (unit tests first) and, beside
# the unit tests, the install-from-scratch test and then the Ray tests — mostly one core of
# pip unpacking and Ray starting up, where the unit tests leave the other core idle a good
# part of the time — and then SIDE_TESTS: modules with servers or pipelines of their own and
# no timing bounds (speech, docs examples, Qwen3-Omni, replicas, the omni families' parity,
# the AR engine's batching and scheduler checks), which would otherwise end the main run; the
# integration and other e2e tests, whose bounds are timings, run after the unit tests. The
# second run's output is shown when both are done; any of them failing fails the target.
SIDE_TESTS := tests/e2e/test_speech_api.py tests/e2e/test_speech_stream.py \
	tests/e2e/test_speech_clone.py tests/e2e/test_docs_examples.py \
	tests/e2e/test_qwen3_omni_api.py tests/e2e/test_replicas_api.py \
	tests/integration/test_replicas.py tests/integration/test_qwen2_5_omni.py \
	tests/integration/test_qwen3_omni.py tests/unit/stage/ar/test_engine_batching.py \
	tests/unit/stage/ar/test_scheduler_fairness.py
test: install
	@side_log=$$(mktemp); \
	( $(BIN)/python -m pytest -q -p no:cacheprovider -m "not ray" tests/e2e/test_packaging.py; \
	  first=$$?; $(BIN)/python -m pytest -q -p no:cacheprovider -m ray tests; \
	  second=$$?; $(BIN)/python -m pytest -q -p no:cacheprovider -m "not ray" $(SIDE_TESTS); \
	  third=$$?; test $$first = 0 && test $$second = 0 && test $$third = 0 ) >$$side_log 2>&1 & \
	side=$$!; \
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not ray" \
		--ignore=tests/e2e/test_packaging.py $(addprefix --ignore=,$(SIDE_TESTS)) \
		tests/unit tests/integration tests/e2e; main=$$?; \
	wait $$side; side_status=$$?; \
	echo "--- beside the unit tests: tests/e2e/test_packaging.py, the Ray tests, then $(SIDE_TESTS)"; \
	cat $$side_log; rm -f $$side_log; \
	test $$main = 0 && test $$side_status = 0

test-unit: install
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

lint: install
	$(BIN)/ruff check omnistage tests examples
	$(BIN)/ruff format --check omnistage tests examples
	$(BIN)/mypy omnistage

bench: install
	$(BIN)/python -m omnistage.cli bench all --out bench-results

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
