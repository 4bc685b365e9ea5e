"""Process and device memory readings, for honest ``freed_bytes`` figures."""

from __future__ import annotations

import torch


def process_resident_bytes() -> int:
    """Resident set size of this process (``VmRSS``), in bytes."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("VmRSS not found in /proc/self/status")


def device_used_bytes(device: str | torch.device) -> int:
    """Memory in use on ``device``: the process RSS on the host, used device memory on CUDA."""
    dev = torch.device(device)
    if dev.type == "cuda":
        free, total = torch.cuda.mem_get_info(dev)
        return int(total - free)
    return process_resident_bytes()
