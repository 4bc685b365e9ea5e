"""Building modules without memory for their weights: parameters on ``meta``, buffers real.

Library classes (diffusers', transformers') are built this way; the stage then adopts them
into its arena and the loader fills them. Buffers are created for real because non-persistent
ones (positional tables, filters) are derived data that no checkpoint holds.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from torch import nn

_META_LOCK = threading.RLock()  # one ``parameters_on_meta`` build at a time


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within the block, parameters registered by this thread move to ``meta``; buffers stay
    real.

    Patches ``nn.Module.register_parameter`` process-wide (stage engines may be threads of one
    process): builds take turns, so each restores what it found, and modules that other
    threads build meanwhile are left alone. Each parameter is first made by its module as an
    uninitialised CPU tensor (no pages are touched), then replaced before its initialiser runs.
    """
    with _META_LOCK:
        original = nn.Module.register_parameter
        builder = threading.get_ident()

        def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            original(module, name, param)
            if (
                param is not None
                and param.device.type != "meta"
                and threading.get_ident() == builder
            ):
                module._parameters[name] = nn.Parameter(
                    param.to("meta"), requires_grad=param.requires_grad
                )

        nn.Module.register_parameter = register  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            nn.Module.register_parameter = original  # type: ignore[method-assign]
