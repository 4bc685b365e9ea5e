"""STUB of vllm_omni.diffusion.data.

- ``DiffusionParallelConfig``: referenced by tests/model_tests/diffusion/config_types.py (offline
  builders only); constructing one raises.
- ``resolve_model_class_name``: used by ``resolve_tiny_model_path`` inside the upstream
  ``iter_omni_server``, which the plugin replaces; it reads a Hugging Face model_index.json, which
  needs the network, so it raises.
"""


class DiffusionParallelConfig:
    def __init__(self, *args, **kwargs):
        raise RuntimeError(
            "vllm_omni.diffusion.data is stubbed: the in-process engine cannot run here"
        )


def resolve_model_class_name(model: str, *args, **kwargs):
    raise RuntimeError(
        f"vllm_omni.diffusion.data is stubbed: cannot resolve {model!r} (needs the HF hub)"
    )
