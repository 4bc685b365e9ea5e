"""STUB of vllm.config: the session fixture default_vllm_config builds a VllmConfig(DeviceConfig)
and enters set_current_vllm_config(); nothing reads it when the server is external."""

from contextlib import contextmanager


class DeviceConfig:
    def __init__(self, device: str = "cpu", **kwargs):
        self.device = device


class VllmConfig:
    def __init__(self, device_config: DeviceConfig | None = None, **kwargs):
        self.device_config = device_config or DeviceConfig()


_CURRENT: VllmConfig | None = None


@contextmanager
def set_current_vllm_config(config: VllmConfig, *args, **kwargs):
    global _CURRENT
    previous, _CURRENT = _CURRENT, config
    try:
        yield
    finally:
        _CURRENT = previous


def get_current_vllm_config() -> VllmConfig:
    return _CURRENT or VllmConfig()
