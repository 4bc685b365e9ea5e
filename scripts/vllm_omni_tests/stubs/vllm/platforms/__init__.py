"""STUB of vllm.platforms: the test process is a client; it reports a CPU platform with no
accelerator, so tests/helpers/mark.py adds no "Need at least N CUDA GPUs" skip."""


class _CpuPlatform:
    device_type = "cpu"
    device_name = "cpu"

    def is_cuda(self) -> bool:
        return False

    def is_rocm(self) -> bool:
        return False

    def is_xpu(self) -> bool:
        return False

    def is_cpu(self) -> bool:
        return True

    def is_cuda_alike(self) -> bool:
        return False

    def device_count(self) -> int:
        return 0


current_platform = _CpuPlatform()
