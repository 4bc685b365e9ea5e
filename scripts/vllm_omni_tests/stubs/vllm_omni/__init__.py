"""STUB of the vllm_omni package root, overlaid on the real checkout.

The real ``vllm_omni/__init__.py`` imports vLLM's engine (``patch.py``, ``config.model``), which
has no build here. This stub replaces only the package root and the sub-packages stubbed beside
it (platforms, config, inputs, outputs, diffusion, entrypoints). Every other submodule is
imported from the vLLM-Omni checkout itself: ``__path__`` ends with the checkout's
``vllm_omni`` folder, so e.g. ``vllm_omni.utils.tracking_parser`` (used by the example clients)
is the real code.

The checkout is $VLLM_OMNI_CHECKOUT (set by run.sh), else the current directory.
"""

from __future__ import annotations

import os

__version__ = "0.0.0+omnistage-stub"
__version_tuple__ = (0, 0, 0)


def _checkout_package_dir() -> str | None:
    for root in (os.environ.get("VLLM_OMNI_CHECKOUT"), os.getcwd()):
        if root and os.path.isfile(os.path.join(root, "vllm_omni", "__init__.py")):
            return os.path.realpath(os.path.join(root, "vllm_omni"))
    return None


_real = _checkout_package_dir()
if _real is not None and _real not in __path__:
    __path__.append(_real)  # type: ignore[name-defined]


def __getattr__(name: str):
    if name in ("Omni", "AsyncOmni", "OmniModelConfig"):
        raise RuntimeError(f"vllm_omni.{name} is stubbed: the in-process engine cannot run here")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
