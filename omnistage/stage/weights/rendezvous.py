"""Joining a trainer's process group for weight transfer (backend ``nccl``: NCCL on CUDA,
gloo on the CPU), within the transfer's ``timeout_s`` as a whole: torch's store retries its
connect past its own timeout (8.6 s for 5 s to a port nobody listens on), so the trainer's
port is awaited here first, and each later step gets what is left of the time."""

from __future__ import annotations

import datetime
import socket
import time
from typing import Any

from omnistage.rl.protocol import InitInfo

# torch.distributed's errors of a rendezvous nobody joined (the store's connect, a group whose
# other ranks never came).
RENDEZVOUS_ERRORS = frozenset({"DistNetworkError", "DistStoreError", "DistTimeoutError"})


def join_trainer(info: InitInfo, device_type: str) -> Any:
    """This stage's process group with the trainer (``TimeoutError`` or one of
    ``RENDEZVOUS_ERRORS`` when nobody joined in time)."""
    import torch.distributed as dist

    deadline = time.monotonic() + info.timeout_s
    await_listener(info.master_address, info.master_port, deadline)

    def left() -> datetime.timedelta:
        return datetime.timedelta(seconds=max(0.1, deadline - time.monotonic()))

    store = dist.TCPStore(
        info.master_address, info.master_port, info.world_size, is_master=False, timeout=left()
    )
    if device_type == "cuda":  # never run on a GPU yet
        nccl = dist.ProcessGroupNCCL
        options = nccl.Options()
        options._timeout = left()
        return nccl(store, info.rank_offset, info.world_size, options)
    return dist.ProcessGroupGloo(store, info.rank_offset, info.world_size, left())


def await_listener(address: str, port: int, deadline: float) -> None:
    """Until something listens at ``address:port``; ``TimeoutError`` at ``deadline``."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"nothing listens at {address}:{port}")
        try:
            with socket.create_connection((address, port), timeout=min(1.0, left)):
                return
        except OSError:
            time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))
