"""STUB of vLLM for running vLLM-Omni's tests against a foreign server (see ../../README.md).

Only the names vLLM-Omni's test helpers import at module level are defined. Nothing here
runs a model; anything that would need the real engine raises.
"""

from typing import TypedDict

from . import envs  # noqa: F401

__version__ = "0.0.0+omnistage-stub"


class TextPrompt(TypedDict, total=False):
    """vllm.inputs.TextPrompt: a dict with a ``prompt`` key (used by the offline runner only)."""

    prompt: str
    multi_modal_data: dict
    mm_processor_kwargs: dict


class SamplingParams:
    """Placeholder: the offline engine path is not supported with the stub."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            "vllm.SamplingParams is stubbed: the offline (in-process) engine path cannot run here"
        )
