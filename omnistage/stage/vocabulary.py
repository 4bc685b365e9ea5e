"""The control vocabulary, defined once: sleep levels, modes for requests in flight, memory
tags and stage ids, with the one check (and the one error message) for each. The typed
control operations (``omnistage.stage.control``), the HTTP bodies, the engine client and
``omnistage ctl`` all use these; see ``docs/control-plane.md``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from omnistage.errors import InvalidRequestError

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
MEMORY_TAGS = (WEIGHTS, KV_CACHE)
# The weight tags of a stage whose components sleep apart (a diffusion pipeline's text
# encoders, transformer and VAE; ``models/diffusion/pipeline.py`` adopts them so); there
# ``weights`` names all of them.
COMPONENT_TAGS = ("text_encoders", "transformer", "vae")
KNOWN_TAGS = (*MEMORY_TAGS, *COMPONENT_TAGS)
SLEEP_LEVELS = (0, 1, 2)
SLEEP_MODES = ("abort", "wait", "keep")
DEFAULT_SLEEP_LEVEL = 2
DEFAULT_SLEEP_MODE = "abort"
ACK_STATUSES = ("SUCCESS", "ERROR", "SKIPPED")
NOT_SLEEPING = "Target stages are not sleeping."
ALREADY_SLEEPING = "Target stages are already sleeping."


def check_level(level: object) -> int:
    if isinstance(level, bool) or level not in SLEEP_LEVELS:
        raise InvalidRequestError("level", f"must be one of {list(SLEEP_LEVELS)}, got {level!r}")
    return int(level)  # type: ignore[call-overload]


def check_mode(mode: object) -> str:
    if mode not in SLEEP_MODES:
        raise InvalidRequestError("mode", f"must be one of {list(SLEEP_MODES)}, got {mode!r}")
    return str(mode)


def check_tags(tags: Iterable[str] | None, known: Sequence[str] = KNOWN_TAGS) -> list[str] | None:
    """``None`` (every tag) or the distinct tags asked for; empty or unknown tags are refused
    (``known``: the tags a stage has, or every tag there is). On a stage whose weights are
    component tags, ``weights`` stands for all of them."""
    if tags is None:
        return None
    if isinstance(tags, str):
        raise InvalidRequestError("tags", f"must be a list of tags, got the string {tags!r}")
    chosen = list(dict.fromkeys(tags))
    if not chosen:
        raise InvalidRequestError("tags", "must not be empty; leave it out for every tag")
    if WEIGHTS in chosen and WEIGHTS not in known:
        at = chosen.index(WEIGHTS)
        components = [t for t in known if t != KV_CACHE]
        chosen = list(dict.fromkeys([*chosen[:at], *components, *chosen[at + 1 :]]))
    unknown = [t for t in chosen if t not in known]
    if unknown:
        raise InvalidRequestError("tags", f"unknown tags {unknown}; known tags are {list(known)}")
    return chosen


def check_stage_ids(
    stage_ids: Iterable[object], num_stages: int, field: str = "stage_ids"
) -> list[int]:
    """The distinct stage ids asked for, or ``InvalidRequestError`` naming ``field`` and the
    valid range."""
    ids = list(dict.fromkeys(stage_ids))
    bad = [
        sid
        for sid in ids
        if not isinstance(sid, int) or isinstance(sid, bool) or not 0 <= sid < num_stages
    ]
    if bad:
        raise InvalidRequestError(
            field, f"unknown stage ids {bad}; valid stage ids are 0..{num_stages - 1}"
        )
    return ids  # type: ignore[return-value]
