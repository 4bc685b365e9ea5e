"""STUB of vllm_omni.inputs.data: the names are imported by tests/helpers/runtime.py and used only
by the in-process OmniRunner, which cannot run here."""

from typing import Any, TypedDict


class OmniTextPrompt(TypedDict, total=False):
    prompt: str
    negative_prompt: str
    multi_modal_data: dict


class OmniDiffusionSamplingParams:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise RuntimeError(
            "vllm_omni.inputs.data is stubbed: the in-process engine cannot run here"
        )


OmniPromptType = Any
