"""pytest plugin: run vLLM-Omni's own online-serving tests, unmodified, against omnistage.

Loaded with ``-p omnistage_plugin`` from the root of a vLLM-Omni checkout (run.sh does this).
It

1. puts ``stubs/`` (beside this file) first on ``sys.path`` and imports the ``vllm`` and
   ``vllm_omni`` stubs before the checkout's root reaches ``sys.path`` (see stubs/README in
   ../README.md: what is stubbed and why);
2. replaces ``tests.helpers.runtime.iter_omni_server`` (what the ``omni_server`` /
   ``omni_server_function`` fixtures call) with a launcher that maps the upstream model name to
   an omnistage tiny pipeline and runs ``omnistage serve`` on 127.0.0.1;
3. strips the "Need at least N CUDA GPUs" ``skipif`` marks (only added when a real CUDA vLLM
   is importable; the stub reports no accelerator).

Options (all optional): ``--omnistage-bin`` (default: $OMNISTAGE_BIN, else ``omnistage`` on
PATH), ``--omnistage-log-dir`` (server logs; default $VLLM_OMNI_TESTS_LOG_DIR or a temp dir),
``--omnistage-startup-timeout`` (seconds, default 900), ``--omnistage-reuse-servers`` (keep one
server per distinct launch command for the whole session instead of one per fixture instance).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Generator
from typing import Any

_HERE = os.path.dirname(os.path.abspath(__file__))
_STUBS = os.path.join(_HERE, "stubs")
if _STUBS in sys.path:
    sys.path.remove(_STUBS)
sys.path.insert(0, _STUBS)

# Pin the stubs in sys.modules now: pytest later prepends the checkout root to sys.path (tests/ is
# a package), and the checkout's own vllm_omni/__init__.py needs a real vLLM build.
import pytest  # noqa: E402
import vllm  # noqa: E402,F401
import vllm_omni  # noqa: E402,F401

if not getattr(vllm, "__version__", "").endswith("omnistage-stub") or not getattr(
    vllm_omni, "__version__", ""
).endswith("omnistage-stub"):
    raise RuntimeError(
        f"omnistage_plugin: expected the stubs from {_STUBS}, got {vllm!r} / {vllm_omni!r}"
    )


# --------------------------------------------------------------------------------------------
# Model name -> omnistage pipeline
# --------------------------------------------------------------------------------------------


# (predicate on the upstream served name, kind, target): kind "pipeline" serves a built-in
# pipeline by name; kind "preset" builds `omnistage build-tiny --preset target` once (unless the
# installed omnistage already has a built-in pipeline of that name) and serves the folder.
def _model_target(model: str) -> tuple[str, str] | None:
    name = model.strip().rstrip("/")
    base = name.split("/")[-1].lower()
    if name == "Qwen/Qwen2.5-Omni-7B" or base.startswith("qwen2.5-omni"):
        return ("pipeline", "tiny-qwen2.5-omni")
    if base.startswith("qwen3-omni"):
        return ("pipeline", "tiny-qwen3-omni")
    if base.startswith("qwen3-tts-") and base.endswith("-customvoice"):
        return ("pipeline", "tiny-qwen3-tts-customvoice")
    if base.startswith("qwen3-tts-") and base.endswith("-voicedesign"):
        return ("pipeline", "tiny-qwen3-tts-voicedesign")
    if base.startswith("qwen3-tts-") and base.endswith("-base"):
        return ("pipeline", "tiny-qwen3-tts-base")
    if base.startswith("flux.1-"):
        return ("pipeline", "tiny-flux")
    if base.startswith("wan2."):
        return ("pipeline", "tiny-wan")
    if name in ("Qwen/Qwen-Image", "Qwen/Qwen-Image-2512"):
        return ("preset", "tiny-qwen-image")
    if base.startswith("stable-diffusion-3"):
        return ("preset", "tiny-sd3")
    return None


_DIFFUSION_TARGETS = {"tiny-flux", "tiny-wan", "tiny-qwen-image", "tiny-sd3"}
# vLLM-Omni has no per-request pixel cap and these tests were written for GPU servers; omnistage
# caps requests at 512x512 on CPU. The runner lifts the cap to omnistage's CUDA default (2048x2048)
# for diffusion pipelines so the sizes the tests ask for (up to 1024x1024) reach the pipeline.
_DIFFUSION_MAX_IMAGE_PIXELS = 2048 * 2048

# vLLM fetches http(s) media from any host; omnistage only from --allowed-media-domains. The
# example clients send media URLs on these hosts (vLLM's public S3 bucket, a Hugging Face dataset
# and the hosts its downloads redirect to), so omni servers allow them. (Whether they can be
# reached is another matter: not from an offline machine.)
_MEDIA_DOMAINS = [
    "vllm-public-assets.s3.us-west-2.amazonaws.com",
    "huggingface.co",
    "cdn-lfs.huggingface.co",
    "cdn-lfs.hf.co",
    "cdn-lfs-us-1.hf.co",
    "cas-bridge.xethub.hf.co",
]

# Upstream flags with an omnistage equivalent of the same meaning, passed on (flag -> arity).
_PASSTHROUGH = {
    "--max-num-seqs": 1,
    "--max-model-len": 1,
    "--max-num-batched-tokens": 1,
    "--enable-prefix-caching": 0,
    "--no-enable-prefix-caching": 0,
}


def translate_server_args(server_args: list[str] | None) -> tuple[list[str], list[str]]:
    """Return (omnistage args, ignored upstream args).

    vLLM-Omni's parallelism / offload / cache-backend / deploy flags (--usp, --cfg-parallel-size,
    --tensor-parallel-size, --enable-cpu-offload, --cache-backend, --vae-use-tiling,
    --async-chunk, --block-size, --enable-prompt-tokens-details, ...) change how a GPU server
    computes, not what the API answers; omnistage has no such flags, so they are dropped (and
    listed in the server log). ``--stage-overrides`` enabling prefix caching becomes
    ``--enable-prefix-caching``.
    """
    args = list(server_args or [])
    out: list[str] = []
    ignored: list[str] = []
    i = 0
    while i < len(args):
        flag = args[i]
        key, eq, inline = flag.partition("=")
        values: list[str] = []
        j = i + 1
        if not eq:
            while j < len(args) and not args[j].startswith("--"):
                values.append(args[j])
                j += 1
        else:
            values = [inline]
        if key in _PASSTHROUGH:
            n = _PASSTHROUGH[key]
            out.append(key)
            out.extend(values[:n])
            ignored.extend(values[n:])
        elif key == "--stage-overrides" and values:
            try:
                overrides = json.loads(values[0])
            except ValueError:
                overrides = {}
            if any(
                isinstance(v, dict) and v.get("enable_prefix_caching") is True
                for v in overrides.values()
            ):
                out.append("--enable-prefix-caching")
            ignored.append(" ".join([key, *values]))
        else:
            ignored.append(" ".join([key, *values]))
        i = j
    return out, ignored


# --------------------------------------------------------------------------------------------
# omnistage process handling
# --------------------------------------------------------------------------------------------

_RESERVED_PORTS = range(8000, 8021)  # other engineers' servers
_live: dict[int, subprocess.Popen] = {}  # pid -> process started by this plugin
_reuse_cache: dict[tuple, OmnistageServer] = {}
_build_lock = threading.Lock()
_help_cache: dict[str, str] = {}


def _free_port() -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _RESERVED_PORTS:
            return port


def _omnistage_bin(config: pytest.Config) -> str:
    value = (
        config.getoption("--omnistage-bin")
        or os.environ.get("OMNISTAGE_BIN")
        or shutil.which("omnistage")
    )
    if not value:
        raise pytest.UsageError("omnistage CLI not found: put it on PATH or pass --omnistage-bin")
    return value


def _serve_help(binary: str) -> str:
    if binary not in _help_cache:
        res = subprocess.run(
            [binary, "serve", "--help"], capture_output=True, text=True, env=_server_env()
        )
        _help_cache[binary] = res.stdout + res.stderr
    return _help_cache[binary]


def _builtin_pipelines(binary: str) -> set[str]:
    text = " ".join(_serve_help(binary).split())
    start = text.find("--pipeline PIPELINE Built-in pipeline")
    if start < 0:
        return set()
    segment = text[start : text.find("--config", start)]
    segment = segment.split(":", 1)[-1].replace("- ", "-")  # undo argparse's hyphen wrapping
    return {tok.strip(" .,") for tok in segment.split(",") if tok.strip(" .,")}


def _built_preset_dir(binary: str, preset: str, log_dir: str) -> str:
    """``omnistage build-tiny --preset P`` once per session (into the log folder, so the model
    always matches the omnistage being served), return the folder."""
    root = os.path.join(log_dir, "models")
    target = os.path.join(root, preset)
    with _build_lock:
        if os.path.isdir(target):
            return target
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=f".{preset}-", dir=root)
        out_dir = os.path.join(tmp, preset)
        log_path = os.path.join(log_dir, f"build-tiny-{preset}.log")
        with open(log_path, "w") as log:
            res = subprocess.run(
                [binary, "build-tiny", "--preset", preset, out_dir],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_server_env(),
            )
        if res.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise RuntimeError(
                f"omnistage build-tiny --preset {preset} failed (rc={res.returncode}); log: {log_path}"
            )
        if os.path.exists(target):
            shutil.rmtree(target)
        os.rename(out_dir, target)
        shutil.rmtree(tmp, ignore_errors=True)
        return target


def _server_env() -> dict[str, str]:
    env = os.environ.copy()
    # The stubs (and the plugin folder) are for the test process and the example clients only.
    for key in ("PYTHONPATH", "VLLM_OMNI_CHECKOUT"):
        env.pop(key, None)
    # $OMNISTAGE_SRC: a copy of omnistage's source (run.sh's OMNISTAGE_REV exports a `git archive`
    # of a commit there) imported ahead of the editable install, so a run does not see files other
    # people are editing in the working tree.
    src = os.environ.get("OMNISTAGE_SRC")
    if src:
        env["PYTHONPATH"] = src
    return env


def _tail(path: str, n: int = 40) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-n:])
    except OSError:
        return ""


def _kill_group(proc: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM the omnistage parent (it shuts its stages down), then SIGKILL whatever is left of
    its process group."""
    if proc.poll() is None:
        proc.terminate()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)
    _live.pop(proc.pid, None)


def _kill_all() -> None:
    for proc in list(_live.values()):
        _kill_group(proc, grace_s=5.0)
    _reuse_cache.clear()


atexit.register(_kill_all)


class OmnistageServer:
    """What the upstream tests read from ``omni_server``: host, port, model, log_stats,
    serve_args, proc (plus the omnistage command and its log file)."""

    def __init__(
        self,
        *,
        model: str,
        port: int,
        cmd: list[str],
        log_path: str,
        log_stats: bool,
        ignored: list[str],
    ):
        self.host = "127.0.0.1"
        self.port = port
        self.model = model
        self.log_stats = log_stats
        self.cmd = cmd
        self.serve_args = cmd[2:]
        self.ignored_args = ignored
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            if s.connect_ex((self.host, self.port)) == 0:
                raise RuntimeError(
                    f"port {self.port} is already in use: another server is running there"
                )
        with open(self.log_path, "a") as log:
            log.write(f"# {' '.join(self.cmd)}\n")
            if self.ignored_args:
                log.write(
                    f"# upstream server args not applicable to omnistage (ignored): {self.ignored_args}\n"
                )
            log.flush()
            self.proc = subprocess.Popen(
                self.cmd,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_server_env(),
                start_new_session=True,
            )
        _live[self.proc.pid] = self.proc
        deadline = time.monotonic() + timeout_s
        url = f"http://{self.host}:{self.port}/health"
        while time.monotonic() < deadline:
            rc = self.proc.poll()
            if rc is not None:
                _live.pop(self.proc.pid, None)
                raise RuntimeError(
                    f"omnistage exited with code {rc} before becoming ready: {' '.join(self.cmd)}\n"
                    f"--- {self.log_path} (tail) ---\n{_tail(self.log_path)}"
                )
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        print(
                            f"omnistage ready on {self.host}:{self.port} ({self.model}); log: {self.log_path}"
                        )
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(
            f"omnistage not healthy after {timeout_s}s: {' '.join(self.cmd)}\n{_tail(self.log_path)}"
        )

    def stop(self) -> None:
        if self.proc is not None:
            _kill_group(self.proc)


def _log_dir(config: pytest.Config) -> str:
    path = config.getoption("--omnistage-log-dir") or os.environ.get("VLLM_OMNI_TESTS_LOG_DIR")
    if not path:
        path = getattr(config, "_omnistage_tmp_log_dir", None) or tempfile.mkdtemp(
            prefix="omnistage-vllm-omni-logs-"
        )
        config._omnistage_tmp_log_dir = path  # type: ignore[attr-defined]
    os.makedirs(path, exist_ok=True)
    return path


def omnistage_iter_server(
    request: Any, run_level: str, model_prefix: str, omni_fixture_lock: threading.Lock
) -> Generator[OmnistageServer, Any, None]:
    """Drop-in for tests.helpers.runtime.iter_omni_server (same signature, same yield contract)."""
    config = request.config
    with omni_fixture_lock:
        params = request.param
        # MODEL_PREFIX points at local copies of the real checkpoints: not used here.
        model = params.model
        target = _model_target(model)
        if target is None:
            pytest.fail(
                f"omnistage runner: model name {model!r} has no omnistage mapping", pytrace=False
            )
        kind, name = target
        binary = _omnistage_bin(config)
        log_dir = _log_dir(config)
        if kind == "preset" and name not in _builtin_pipelines(binary):
            source = [_built_preset_dir(binary, name, log_dir)]
        else:
            source = ["--pipeline", name]
        extra, ignored = translate_server_args(params.server_args)
        if params.stage_config_path:
            ignored.append(f"stage_config_path={params.stage_config_path}")
        if params.use_stage_cli:
            ignored.append("use_stage_cli=True")
        if params.env_dict:
            ignored.append(f"env_dict={params.env_dict}")
        if name in _DIFFUSION_TARGETS and "--max-image-pixels" in _serve_help(binary):
            extra += ["--max-image-pixels", str(_DIFFUSION_MAX_IMAGE_PIXELS)]
        if name not in _DIFFUSION_TARGETS and "--allowed-media-domains" in _serve_help(binary):
            extra += ["--allowed-media-domains", *_MEDIA_DOMAINS]
        log_stats = "--disable-log-stats" not in (params.server_args or [])
        reuse = config.getoption("--omnistage-reuse-servers")
        key = (tuple(source), model, params.port, tuple(extra))
        server = _reuse_cache.get(key) if reuse else None
        if server is not None and (server.proc is None or server.proc.poll() is not None):
            server = None
        if server is None:
            port = params.port or _free_port()
            cmd = [
                binary,
                "serve",
                *source,
                "--served-model-name",
                model,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--enable-sleep-mode",
                *extra,
            ]
            safe = model.replace("/", "_")
            log_path = os.path.join(
                log_dir, f"omnistage-{safe}-{port}-{int(time.time() * 1000)}.log"
            )
            server = OmnistageServer(
                model=model,
                port=port,
                cmd=cmd,
                log_path=log_path,
                log_stats=log_stats,
                ignored=ignored,
            )
            server.start(float(config.getoption("--omnistage-startup-timeout")))
            if reuse:
                # A reused server on a pinned port would block the next one: keep one per port.
                for other_key, other in list(_reuse_cache.items()):
                    if other.port == server.port:
                        other.stop()
                        del _reuse_cache[other_key]
                _reuse_cache[key] = server
        else:
            print(f"omnistage reused on {server.host}:{server.port} ({model})")
        print("OmniServer started successfully")
    try:
        yield server
    finally:
        if not reuse:
            print("OmniServer stopping...")
            server.stop()
            print("OmniServer stopped")


# --------------------------------------------------------------------------------------------
# pytest hooks
# --------------------------------------------------------------------------------------------


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("omnistage", "run vLLM-Omni's tests against omnistage")
    group.addoption(
        "--omnistage-bin", default=None, help="omnistage CLI (default: $OMNISTAGE_BIN or PATH)"
    )
    group.addoption("--omnistage-log-dir", default=None, help="folder for the servers' logs")
    group.addoption(
        "--omnistage-startup-timeout", default=900, type=float, help="seconds to wait for /health"
    )
    group.addoption(
        "--omnistage-reuse-servers",
        action="store_true",
        default=False,
        help="keep one omnistage server per distinct launch command for the whole session",
    )


def _install_http_error_detail() -> None:
    """Diagnostics only: append the (start of the) response body to the message of
    ``requests``' HTTPError, so a 400 from omnistage says why. Pass/fail is unchanged."""
    import requests

    original = requests.models.Response.raise_for_status
    if getattr(original, "_omnistage_detail", False):
        return

    def raise_for_status(self: requests.Response) -> None:
        try:
            original(self)
        except requests.HTTPError as exc:
            try:
                body = self.text[:1000]
            except Exception:  # noqa: BLE001 - best effort
                body = "<unreadable>"
            raise requests.HTTPError(f"{exc} -- response body: {body}", response=self) from None

    raise_for_status._omnistage_detail = True  # type: ignore[attr-defined]
    requests.models.Response.raise_for_status = raise_for_status  # type: ignore[method-assign]


def _patch_runtime() -> None:
    import tests.helpers.runtime as runtime

    runtime.iter_omni_server = omnistage_iter_server


def pytest_sessionstart(session: pytest.Session) -> None:
    _install_http_error_detail()
    print(f"omnistage plugin: server logs in {_log_dir(session.config)}")


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(
    session: pytest.Session, config: pytest.Config, items: list[pytest.Item]
) -> None:
    _patch_runtime()
    seen: set[int] = set()
    for item in items:
        node: Any = item
        while node is not None:
            if id(node) not in seen:
                seen.add(id(node))
                node.own_markers[:] = [
                    m
                    for m in node.own_markers
                    if not (
                        m.name == "skipif"
                        and str(m.kwargs.get("reason", "")).startswith("Need at least")
                    )
                ]
            node = node.parent


def pytest_runtest_setup(item: pytest.Item) -> None:
    # In case a module imported tests.helpers.runtime lazily after collection.
    _patch_runtime()


def pytest_unconfigure(config: pytest.Config) -> None:
    _kill_all()
