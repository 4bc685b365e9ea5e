"""How a chunk of a trainer's tensors reaches a stage, one class per way (vLLM's
``distributed/weight_transfer``: a base and one engine per backend): ``nccl`` (a broadcast in
the process group the trainer and the stage joined — NCCL on CUDA, gloo on the CPU), ``ipc``
(same host: each tensor's shared-memory segment or CUDA IPC handle), ``staged`` (the trainer
wrote them into the stage's own shared staging; the chunk is only checked in place). Each
``receive`` runs on the transfer's thread, fills the staging buffers and refuses non-finite
values; ``transport_for`` picks the class."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar

import torch

from omnistage.rl.protocol import UpdateInfo
from omnistage.stage.weights.checks import all_finite, receive_checked, refuse_nonfinite
from omnistage.stage.weights.ipc import SharedSegments, from_ipc_handle

Named = list[tuple[str, torch.Tensor]]  # (checkpoint name, staging buffer), in chunk order


class Transport(ABC):
    """``name``: the backend's name on the wire; ``shares_staging``: the trainer may write
    into the stage's shared staging (``start`` with ``shared_staging``); ``lost_on_error``: a
    failed receive leaves the transport unusable (a broken collective), so the next update
    needs a new ``init``."""

    name: ClassVar[str]
    shares_staging: ClassVar[bool] = False
    lost_on_error: ClassVar[bool] = False

    @abstractmethod
    def receive(self, named: Named, info: UpdateInfo, device: torch.device) -> None:
        """Fill each buffer of ``named`` with its tensor, refusing non-finite values."""

    def uses_gloo(self, device: torch.device) -> bool:
        """Whether tensors come through gloo (whose dtypes are fewer)."""
        return False


class NcclTransport(Transport):
    """A broadcast from the trainer's rank 0 in the group ``init`` joined."""

    name = "nccl"
    lost_on_error = True

    def __init__(self, group: Any) -> None:
        self.group = group

    def receive(self, named: Named, info: UpdateInfo, device: torch.device) -> None:
        receive_checked(self.group, named, device)

    def uses_gloo(self, device: torch.device) -> bool:
        return device.type != "cuda"


class IpcTransport(Transport):
    """Each tensor from the handle the chunk gives (a segment and offset, or CUDA IPC)."""

    name = "ipc"
    shares_staging = True

    def receive(self, named: Named, info: UpdateInfo, device: torch.device) -> None:
        if info.ipc_handles is None:
            raise ValueError("the ipc backend needs handles")  # checked on the loop before
        segments = SharedSegments()
        try:
            for i, (name, host) in enumerate(named):
                refuse_nonfinite(name, from_ipc_handle(info.ipc_handles[i], host, segments))
        finally:
            segments.close()


class StagedTransport(Transport):
    """The trainer wrote the chunk into the stage's shared staging: checked in place."""

    name = "staged"

    def receive(self, named: Named, info: UpdateInfo, device: torch.device) -> None:
        for name, host in named:
            refuse_nonfinite(name, all_finite(host))


STAGED = StagedTransport()


def transport_for(backend: str, group: Any = None) -> Transport:
    """The transport of ``backend`` (``nccl`` with the group ``init`` joined)."""
    if backend == NcclTransport.name:
        return NcclTransport(group)
    if backend == IpcTransport.name:
        return IpcTransport()
    raise ValueError(f"unknown weight transfer backend {backend!r}")
