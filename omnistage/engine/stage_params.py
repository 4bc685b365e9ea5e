"""vLLM-Omni's ``sampling_params_list``: one entry of parameters per stage, in stage order.

Each entry becomes the parameters of the request field its stage reads (``sampling_params``,
a speech-token stage's ``talker_params``, ``audio_params``, ``image_params``), translated by
the stage kind's preparer (``from_vllm``). A shorter list leaves the later stages their own
defaults, as vLLM-Omni pads it; a longer one is refused in vLLM-Omni's words. Where the
request also gives a parameter by its own field, the two must agree: one value is never
picked over another silently.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from omnistage.errors import InvalidRequestError
from omnistage.stage.request_preparer import RequestPreparer

FIELD = "sampling_params_list"


def params_by_field(
    entries: Any, preparers: Sequence[RequestPreparer]
) -> dict[str, tuple[int, dict[str, Any]]]:
    """The entries as ``{request field: (stage id, its parameters)}``."""
    if not isinstance(entries, list | tuple):
        raise InvalidRequestError(FIELD, "must be a list of objects, one per stage")
    if len(entries) > len(preparers):
        raise InvalidRequestError(
            FIELD, f"Expected {len(preparers)} sampling params, got {len(entries)}"
        )
    by_field: dict[str, tuple[int, dict[str, Any]]] = {}
    for stage_id, (entry, preparer) in enumerate(zip(entries, preparers, strict=False)):
        if entry is None:
            continue
        if not isinstance(entry, Mapping):
            raise InvalidRequestError(f"{FIELD}.{stage_id}", "must be an object")
        try:
            params = preparer.from_vllm(entry)
        except InvalidRequestError as exc:
            raise exc.under(f"{FIELD}.{stage_id}") from None
        field = preparer.params_field
        if field in by_field and by_field[field][1] != params:
            raise InvalidRequestError(
                f"{FIELD}.{stage_id}",
                f"stages {by_field[field][0]} and {stage_id} take the same parameters "
                f"({field}); give them equal entries",
            )
        by_field[field] = (stage_id, params)
    return by_field


def merge_stage_params(
    given: Mapping[str, Mapping[str, Any] | None],
    entries: Any,
    preparers: Sequence[RequestPreparer],
) -> dict[str, Mapping[str, Any] | None]:
    """The request's parameters by field with the list's entries (if any) merged in."""
    merged: dict[str, Mapping[str, Any] | None] = dict(given)
    if entries is None:
        return merged
    for field, (stage_id, params) in params_by_field(entries, preparers).items():
        own = dict(given.get(field) or {})
        for key, value in params.items():
            if own.get(key) is not None and own[key] != value:  # None: not given
                raise InvalidRequestError(
                    f"{FIELD}.{stage_id}.{key}",
                    f"{value!r} differs from the request's own {key} ({own[key]!r}); give it once",
                )
            own[key] = value
        merged[field] = own
    return merged
