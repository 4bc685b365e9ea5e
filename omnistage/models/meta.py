"""Building modules without memory for their weights: parameters on ``meta``, buffers real.

Library classes (diffusers', transformers') are built this way; the stage then adopts them
into its arena and the loader fills them. Buffers are created for real because non-persistent
ones (positional tables, filters) are derived data that no checkpoint holds.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch import nn

_META_LOCK = threading.RLock()  # one ``parameters_on_meta`` / ``no_weight_init`` at a time
# The in-place initialisers of ``torch.nn.init`` (``normal_``, ``kaiming_uniform_``, ...).
_INITIALISERS = [name for name in dir(nn.init) if name.endswith("_") and not name.startswith("_")]


def _unchanged(tensor: object, *args: object, **kwargs: object) -> object:
    return tensor


@contextlib.contextmanager
def no_weight_init() -> Iterator[None]:
    """Within the block, ``torch.nn.init``'s initialisers leave tensors as they are.

    Weights built on ``meta`` are filled by the loader, so initialising them is wasted work —
    and not cheap: the first initialiser run on a meta tensor imports ``torch._dynamo``
    (about 1 s of a stage's cold start). Patches ``torch.nn.init`` process-wide, under the
    same lock as ``parameters_on_meta``; modules' own in-place fills still run.
    """
    with _META_LOCK:
        saved = {name: getattr(nn.init, name) for name in _INITIALISERS}
        for name in _INITIALISERS:
            setattr(nn.init, name, _unchanged)
        try:
            yield
        finally:
            for name, fn in saved.items():
                setattr(nn.init, name, fn)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Within the block, parameters registered by this thread move to ``meta``; buffers stay
    real.

    Patches ``nn.Module.register_parameter`` process-wide (stage engines may be threads of one
    process): builds take turns, so each restores what it found, and modules that other
    threads build meanwhile are left alone. Each parameter is first made by its module as an
    uninitialised CPU tensor (no pages are touched), then replaced before its initialiser runs.
    """
    with _META_LOCK, no_weight_init():
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


def move_derived_buffers(module: nn.Module, device: torch.device) -> set[str]:
    """Put ``module``'s non-persistent buffers (derived data, outside the arena, built on
    the CPU) on ``device``; returns their names."""
    names = set()
    for prefix, mod in module.named_modules():
        for name in getattr(mod, "_non_persistent_buffers_set", set()):
            buf = mod._buffers.get(name)
            if buf is None:
                continue
            if buf.device != device:
                mod._buffers[name] = buf.to(device)
            names.add(f"{prefix}.{name}" if prefix else name)
    return names
