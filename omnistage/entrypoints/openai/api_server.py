"""App assembly: ``build_app(config)`` + a lifespan that owns one ``AsyncOmni``."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

from omnistage.config import ConfigError, PipelineConfig
from omnistage.entrypoints.openai.server_config import ServerConfig

if TYPE_CHECKING:
    from fastapi import FastAPI

logger = logging.getLogger("omnistage.server")


def init_app_state(engine_client: Any, state: Any, config: ServerConfig) -> None:
    """Everything the routes read from ``app.state``."""
    from omnistage.entrypoints.media import MediaPolicy
    from omnistage.entrypoints.openai.metrics import ServerMetrics
    from omnistage.entrypoints.openai.served import accepted_model_names
    from omnistage.entrypoints.openai.video_jobs import VideoJobs
    from omnistage.entrypoints.openai.voices import VoiceStore
    from omnistage.entrypoints.serve.auth import resolve_control_api_key
    from omnistage.entrypoints.serve.omni_control.journal import ControlJournal
    from omnistage.entrypoints.serve.stage_states import stage_states
    from omnistage.pipelines import cache_dir

    state.engine_client = engine_client
    state.sleeping_stages = set()  # the seed's set, kept by the control routes
    state.stage_states = stage_states(engine_client, state)
    state.served_model_name = config.model_name
    state.served_model_names = config.model_names
    state.accepted_model_names = accepted_model_names(config, engine_client)
    state.trust_request_chat_template = config.trust_request_chat_template
    state.video_jobs = VideoJobs(
        config.max_video_jobs, config.video_job_ttl_s, config.video_storage_dir
    )
    state.voice_store = VoiceStore(
        config.voice_storage_dir or cache_dir().parent / "voices",
        config.max_uploaded_voices,
        config.max_voice_upload_bytes,
    )
    state.chat_dialect = config.chat_dialect
    state.default_modalities = config.default_modalities
    state.api_key = config.api_key
    state.control_api_key = resolve_control_api_key(config.control_api_key)
    state.log_requests = not config.disable_log_requests
    state.media_policy = MediaPolicy.from_config(config)
    state.metrics = ServerMetrics(config.model_name)
    state.control_journal = ControlJournal()  # GET /v1/omni/acks
    if hasattr(engine_client, "add_control_listener"):
        engine_client.add_control_listener(state.metrics.observe_control)
        engine_client.add_control_listener(state.control_journal.record)
        # Sleeps and wakes no route asked for (idle sleep, auto-wake) show in the set too.
        engine_client.add_control_listener(lambda *_: state.stage_states.sleeping_stage_ids())
    if hasattr(engine_client, "add_request_listener"):
        engine_client.add_request_listener(state.metrics.observe_request)


def resolve_pipeline(config: ServerConfig, progress: Callable[[str], None]) -> PipelineConfig:
    """The pipeline to serve, with missing built-in models built (``ConfigError`` if bad)."""

    def on_build(preset: str, path: Any) -> None:
        progress(f"building tiny model preset {preset!r} into {path} (first run only)")

    return config.pipeline_config(on_build=on_build)


def start_engine(
    config: ServerConfig,
    pipeline: PipelineConfig,
    progress: Callable[[str], None],
    prestarted: dict[int, Any] | None = None,
) -> Any:
    """Start the stages (``StageStartupError`` if one cannot start), taking over those in
    ``prestarted`` (``spawn.prestart``)."""
    from omnistage.engine.async_omni import AsyncOmni
    from omnistage.engine.supervisor import RestartPolicy

    for stage in pipeline.stages:
        progress(
            f"starting stage {stage.stage_id} ({stage.kind}, {stage.display_name}) from {stage.model}"
        )
    # The HTTP wakeup route resumes woken stages unless the body says "resume": false.
    engine = AsyncOmni.from_config(
        pipeline,
        stage_init_timeout_s=config.stage_init_timeout_s,
        resume_after_wake=True,
        auto_wake=config.auto_wake,
        restart_policy=RestartPolicy(
            max_restarts=config.max_stage_restarts, window_s=config.stage_restart_window_s
        ),
        prestarted=prestarted,
        distributed_executor_backend=config.distributed_executor_backend,
        paused_request_timeout_s=config.paused_request_timeout_s,
    )
    engine.router.media_threads = config.media_decode_workers  # and their processing
    progress(f"all {pipeline.num_stages} stage(s) ready")
    return engine


def build_app(
    config: ServerConfig, engine_client: Any = None, progress: Callable[[str], None] | None = None
) -> FastAPI:
    """The FastAPI app. With ``engine_client`` given, the app serves it and does not own it."""
    from fastapi import Depends, FastAPI

    from omnistage import __version__
    from omnistage.entrypoints.openai import (
        serving_chat,
        serving_chat_batch,
        serving_completions,
        serving_images,
        serving_speech,
        serving_videos,
        voices,
    )
    from omnistage.entrypoints.openai.body_limit import BodySizeLimit
    from omnistage.entrypoints.openai.http_metrics import HttpMetrics
    from omnistage.entrypoints.openai.server_routes import health_router, models_router
    from omnistage.entrypoints.serve import rl_routes, vllm_compat, vllm_dev
    from omnistage.entrypoints.serve.auth import require_api_key
    from omnistage.entrypoints.serve.errors import register_exception_handlers
    from omnistage.entrypoints.serve.omni_control.rl import router as omni_rl_router
    from omnistage.entrypoints.serve.omni_control.routes import router as omni_control_router

    say = progress or logger.info

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        owned = engine_client is None
        engine = engine_client
        if engine is None:
            # On this (the main) thread, not a worker thread: stage processes die with the
            # thread that spawned them (PR_SET_PDEATHSIG), and no request is served yet.
            engine = start_engine(config, resolve_pipeline(config, say), say)
        init_app_state(engine, app.state, config)
        if hasattr(engine, "start_background_tasks"):
            engine.start_background_tasks()
        try:
            yield
        finally:
            await app.state.video_jobs.close()
            if owned:
                engine.shutdown()

    # No /docs or /redoc: their pages load assets from a CDN, blank on an offline cluster.
    # The schema itself is served below, behind the data key.
    app = FastAPI(
        title="omnistage",
        version=__version__,
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
    )
    app.add_middleware(BodySizeLimit, max_bytes=config.request_body_limit)
    app.add_middleware(HttpMetrics)  # outermost: counts the body limit's 413s too
    register_exception_handlers(app)
    data = [Depends(require_api_key)]

    @app.get("/openapi.json", include_in_schema=False, dependencies=data)
    async def openapi() -> dict[str, Any]:
        return app.openapi()

    app.include_router(serving_chat.router, dependencies=data)
    app.include_router(serving_chat_batch.router, dependencies=data)
    app.include_router(serving_completions.router, dependencies=data)
    app.include_router(serving_images.router, dependencies=data)
    app.include_router(serving_videos.router, dependencies=data)
    app.include_router(serving_speech.router, dependencies=data)
    app.include_router(voices.router, dependencies=data)
    app.include_router(models_router, dependencies=data)
    app.include_router(health_router)
    app.include_router(omni_control_router)
    app.include_router(omni_rl_router)
    app.include_router(vllm_compat.router)
    app.include_router(rl_routes.router)
    app.include_router(vllm_dev.router)
    if not config.no_ui:
        from omnistage.entrypoints.serve.ui import mount_ui

        mount_ui(app)
    return app


def ready_banner(config: ServerConfig, port: int, engine: Any = None) -> str:
    """What to try once the server is up: requests the pipeline being served answers (a chat
    where it writes text, speech where it speaks, a picture or a video where it makes them).
    Keys are never printed, only the variables that hold them in the user's shell."""
    from omnistage.entrypoints.serve.auth import resolve_control_api_key

    base = f"http://{config.host}:{port}"
    data = ' -H "Authorization: Bearer $OMNISTAGE_API_KEY"' if config.api_key else ""
    control = data
    if resolve_control_api_key(config.control_api_key) is not None:
        control = ' -H "Authorization: Bearer $OMNISTAGE_CONTROL_API_KEY"'
    json_body = "-H 'Content-Type: application/json'"
    lines = [f"omnistage is ready at {base} (model {config.model_name!r})"]
    if not config.no_ui:
        lines.append(f"console and playground: {base}/ui")
    if data or control:
        lines.append("keys are not shown: the lines below read them from your shell's variables")
    outputs = _banner_outputs(engine)
    tries = []
    if "text" in outputs:
        tries += [
            f"  curl -s {base}/v1/chat/completions{data} {json_body} \\",
            '    -d \'{"messages": [{"role": "user", "content": "Hello"}], "modalities": ["text"], '
            '"max_tokens": 16}\'',
        ]
    if "audio" in outputs:
        tries += [
            f"  curl -s {base}/v1/chat/completions{data} {json_body} \\",
            '    -d \'{"messages": [{"role": "user", "content": "Say hello"}], '
            '"modalities": ["text", "audio"], "audio": {"format": "wav"}}\' \\',
            "    | python3 -c 'import sys, json, base64; sys.stdout.buffer.write(base64.b64decode("
            'json.load(sys.stdin)["choices"][0]["message"]["audio"]["data"]))\' > hello.wav',
        ]
    if "video" in outputs:
        tries.append(
            f"  curl -s {base}/v1/videos/sync{data} -F prompt='a red cat' -F size=48x32 "
            "-F num_frames=5 -o cat.mp4"
        )
    elif "image" in outputs and "text" not in outputs:
        tries.append(
            f"  curl -s {base}/v1/images/generations{data} {json_body} "
            '-d \'{"prompt": "a red cat", "size": "64x64"}\''
        )
    return "\n".join(
        [
            *lines,
            "try:",
            *tries,
            f"  curl -s {base}/v1/omni/stages{control}",
            f"  curl -s -X POST {base}/v1/omni/sleep{control} {json_body} -d '{{\"stage_ids\": [0]}}'",
            f"  curl -s -X POST {base}/v1/omni/wakeup{control} {json_body} -d '{{\"stage_ids\": [0]}}'",
        ]
    )


def _banner_outputs(engine: Any) -> set[str]:
    """What the served pipeline makes: its output modalities, ``video`` where a video request
    passes its checks (text where nothing says: an app without an engine)."""
    if engine is None or not hasattr(engine, "output_modalities"):
        return {"text"}
    outputs = set(engine.output_modalities())
    if outputs == {"image"} and hasattr(engine, "check"):
        video = {"video": True, "num_frames": 5, "height": 32, "width": 48}
        with contextlib.suppress(Exception):
            engine.check("a red cat", {}, ["image"], image_params=video)
            outputs.add("video")
    return outputs


def run_server(config: ServerConfig) -> None:
    """Serve until interrupted; stage processes are shut down on every exit path."""
    from omnistage.logs import configure_logging

    # First: the stage processes started below inherit the settings (OMNISTAGE_LOG_*).
    configure_logging(config.log_level, config.log_format)

    def progress(message: str) -> None:
        print(f"[omnistage] {message}", flush=True)

    # Everything that can fail on bad settings fails here, before the HTTP server starts, so
    # the CLI reports it in one line; the stages are shut down on every exit path after this.
    # The port first: a port in use was found only once every stage had loaded.
    listener = bind_listener(config.host, config.port)
    try:
        pipeline = resolve_pipeline(config, progress)
    except BaseException:
        listener.close()
        raise
    # The stages start now, importing torch and their models' code while this process
    # imports the engine client and the app (no torch has been imported here yet).
    from omnistage.engine.spawn import prestart, uses_ray

    ray = uses_ray(pipeline, config.distributed_executor_backend)
    prestarted = {} if ray else prestart(pipeline)
    try:
        engine = start_engine(config, pipeline, progress, prestarted)
    except BaseException:
        listener.close()
        raise
    finally:
        for stage in prestarted.values():  # not taken over: start-up failed before
            stage.discard()
    try:
        _serve(config, build_app(config, engine_client=engine), progress, listener)
    finally:
        listener.close()
        engine.shutdown()


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's socket, bound now (``ConfigError`` naming the address when it cannot
    be); uvicorn listens on it once the stages are up."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # IPPROTO_TCP named: asyncio turns Nagle off (TCP_NODELAY) only on connections of a socket
    # whose protocol says TCP; unnamed (0), each reply after the first on a kept-alive
    # connection waited ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise ConfigError(
            f"cannot listen on {host}:{port}: {exc.strerror or exc} (choose another with "
            "--port, or stop what holds it)"
        ) from None
    return sock


def _serve(
    config: ServerConfig,
    app: FastAPI,
    progress: Callable[[str], None],
    listener: socket.socket | None = None,
) -> None:
    import uvicorn

    # No log_config: uvicorn's loggers already log through omnistage's handler
    # (configure_logging), in the same format; uvicorn only sets their level. The access log
    # (a line per request) follows --disable-log-requests.
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_config=None,
            log_level=config.log_level,
            access_log=not config.disable_log_requests,
        )
    )

    original_startup = server.startup

    async def startup(sockets: Any = None) -> None:
        await original_startup(sockets=sockets)
        if server.started:
            port = config.port
            for srv in getattr(server, "servers", []):
                for sock in srv.sockets:
                    port = sock.getsockname()[1]
            progress(ready_banner(config, port, getattr(app.state, "engine_client", None)))

    server.startup = startup  # type: ignore[method-assign]
    # uvicorn drains in-flight requests on Ctrl-C, then re-raises the signal it caught: the
    # drain is the graceful exit, not an error.
    with contextlib.suppress(KeyboardInterrupt):
        server.run(sockets=[listener] if listener is not None else None)


def serve_until_stopped(config: ServerConfig) -> int:
    """``run_server`` for a command line: its exit status, a bad setting in one line."""
    import sys

    from omnistage.config import ConfigError
    from omnistage.errors import StageStartupError

    try:
        run_server(config)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except StageStartupError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # before the server was up: the stages are shut down already
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    # vLLM-Omni's (and vLLM's) launch shape: `python -m ...entrypoints.openai.api_server
    # --model X --port P` takes the flags of `omnistage serve`.
    import sys

    from omnistage.entrypoints.cli_args import parse_serve_args

    _config = parse_serve_args(sys.argv[1:], "python -m omnistage.entrypoints.openai.api_server")
    sys.exit(2 if _config is None else serve_until_stopped(_config))
