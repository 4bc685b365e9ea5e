"""Tagged, sleepable memory: tensors at fixed addresses whose backing memory can be released."""

from omnistage.memory.arena import Arena, ArenaWakeError, SleepReport, TagStats, WakeReport
from omnistage.memory.backend import ArenaError, ArenaOutOfMemoryError, Backend
from omnistage.memory.host import HostBackend
from omnistage.memory.usage import device_used_bytes, process_resident_bytes

__all__ = [
    "Arena",
    "ArenaError",
    "ArenaOutOfMemoryError",
    "ArenaWakeError",
    "Backend",
    "HostBackend",
    "SleepReport",
    "TagStats",
    "WakeReport",
    "device_used_bytes",
    "process_resident_bytes",
]
