"""STUB of vllm_omni.platforms (the real one probes CUDA/ROCm/NPU through vLLM).

``current_omni_platform`` is a CPU platform with no accelerator: the helpers then skip GPU
memory waits/cleanup and run Whisper (if ever reached) on CPU.
"""

from __future__ import annotations


class _CpuOmniPlatform:
    device_type = "cpu"
    device_name = "cpu"

    def is_available(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return True

    def is_cuda(self) -> bool:
        return False

    def is_rocm(self) -> bool:
        return False

    def is_npu(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_musa(self) -> bool:
        return False

    def device_count(self) -> int:
        return 0

    def get_device_count(self) -> int:
        return 0

    def empty_cache(self) -> None:
        return None

    def synchronize(self) -> None:
        return None

    def __getattr__(self, name: str):
        raise RuntimeError(f"vllm_omni.platforms is stubbed (CPU client): {name} is not available")


current_omni_platform = _CpuOmniPlatform()
