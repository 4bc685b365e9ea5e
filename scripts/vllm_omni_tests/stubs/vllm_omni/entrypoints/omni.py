"""STUB of vllm_omni.entrypoints.omni: ``Omni`` (the in-process engine) is imported by
tests/model_tests/diffusion/config_types.py; constructing it raises."""


class Omni:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            "vllm_omni.entrypoints.omni is stubbed: the in-process engine cannot run here"
        )
