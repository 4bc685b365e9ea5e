"""Which models a request may name, and what a data route knows of the stage answering it.

A request's ``model`` must be one the server serves, as vLLM checks it: a served name
(``--served-model-name``, possibly several; else the pipeline's or checkpoint's name) or a
checkpoint folder a stage was started from (as given, or resolved). Anything else is vLLM's
404 (``ModelNotFoundError``); an empty or missing ``model`` means the served one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import Request

from omnistage.entrypoints.openai.server_config import ServerConfig
from omnistage.errors import (
    InvalidRequestError,
    ModelNotFoundError,
    RequestAbortedError,
    StageAsleepError,
)


def accepted_model_names(config: ServerConfig, engine_client: Any) -> frozenset[str]:
    """The served names, ``--model`` as given, and every stage's checkpoint folder."""
    names = set(config.model_names)
    paths = [config.model] if config.model else []
    stages = getattr(getattr(engine_client, "config", None), "stages", None)
    paths += [str(s.model) for s in stages if getattr(s, "model", None)] if stages else []
    for path in paths:
        names.update({path, str(Path(path)), str(Path(path).expanduser().resolve())})
    return frozenset(names)


def check_model(request: Request, asked: str | None) -> str:
    """The model id a reply carries for a request naming ``asked`` (404 unless the server
    serves it): the served name asked, else (none, or a checkpoint folder) the first."""
    state = request.app.state
    served: str = state.served_model_name
    if not asked:
        return served
    accepted = getattr(state, "accepted_model_names", None)
    if accepted is None:  # an app that did not say: as before, any name
        return asked
    if asked not in accepted and str(Path(asked)) not in accepted:
        raise ModelNotFoundError(asked)
    return asked if asked in getattr(state, "served_model_names", ()) else served


def text_stage(engine: Any, modalities: list[str] | None = None) -> int:
    """The stage a text request starts at (the first of its chain)."""
    plan = getattr(engine, "plan", None)
    return int(plan(modalities or ["text"])[0]) if plan is not None else 0


def preparer_of(engine: Any, stage_id: int, field: str) -> Any:
    """The stage's request preparer (its tokenizer, its ``max_model_len``); a 400 naming
    ``field`` for an engine client that tokenizes nothing in this process."""
    router = getattr(engine, "router", None)
    preparer = router.preparer(stage_id) if router is not None else None
    if getattr(preparer, "tokenizer", None) is None:
        raise InvalidRequestError(field, "is not available with this engine client")
    return preparer


def takes_messages(engine: Any, modalities: list[str]) -> bool:
    """Whether the first stage of a request for ``modalities`` takes chat messages (a token
    stage), or a text prompt (a pipeline that starts with a diffusion stage)."""
    router = getattr(engine, "router", None)
    if router is None:
        return True
    preparer = router.preparer(text_stage(engine, modalities))
    return "messages" in getattr(preparer, "PROMPT_FIELDS", ("messages",))


def ended_without(engine: Any, last: Any, what: str) -> Exception:
    """The error of a media request whose stream ended without its media: it was aborted —
    by a sleep with mode ``abort`` (``stage_asleep``, 503 with ``Retry-After``, as a request
    arriving at the sleeping stage gets) or otherwise (``request_aborted``). Never a 200 with
    nothing in it."""
    stage = last.stage_id if last is not None else 0
    asleep = getattr(engine, "is_sleeping", None)
    if asleep is not None and asleep(stage):
        return StageAsleepError(stage)
    return RequestAbortedError(stage, f"the request was aborted before it made {what}")
