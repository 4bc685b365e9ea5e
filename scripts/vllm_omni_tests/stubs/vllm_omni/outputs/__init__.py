"""STUB of vllm_omni.outputs: OmniRequestOutput is a type annotation in tests/helpers/runtime.py
(in-process OmniRunner only)."""


class OmniRequestOutput:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("vllm_omni.outputs is stubbed: the in-process engine cannot run here")
