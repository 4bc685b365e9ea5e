"""What the offline handles (``LLM``, ``Diffusion``) share."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, cast

P = TypeVar("P")


def params_per_input(
    params: P | Sequence[P] | None, kind: type[P], count: int, names: tuple[str, str]
) -> list[P]:
    """The parameters of each of ``count`` inputs: one ``kind`` for all (``None``: the
    defaults), or one per input (``ValueError`` naming ``names``, the parameters' and the
    inputs', if the counts differ)."""
    if params is None or isinstance(params, kind):
        return [params or kind()] * count
    each = list(cast(Sequence[P], params))
    if len(each) != count:
        raise ValueError(f"{len(each)} {names[0]} for {count} {names[1]}")
    return each
