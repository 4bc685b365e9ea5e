"""A trainer's weights into a tensor-parallel AR stage: every rank takes its slice of each
pushed tensor, the same slice the loader reads from a checkpoint (``tp_shards``).

Rank 0's ``WeightSync`` receives and checks whole tensors as a one-rank stage does — their
names, shapes (the checkpoint's, ``full_targets``) and dtypes — staging them in shared
memory. ``finish`` then applies them in two steps, so that the ranks never disagree: every
rank *prepares* (maps rank 0's staging, narrows each tensor to its slice, checks its
weights are awake) and only when all have, every rank *commits* (copies its slices into
its live weights in place; they stay its level-2 reload source). A rank that cannot
prepare makes the whole update refused, nothing applied anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import msgspec
import torch

from omnistage.errors import InvalidRequestError
from omnistage.models.loader import checkpoint_files, open_files
from omnistage.rl.protocol import dtype_name, parse_dtype
from omnistage.stage.control import Ack
from omnistage.stage.vocabulary import WEIGHTS
from omnistage.stage.weights.staging import locate, map_segment


class SyncSlice(msgspec.Struct):
    """Where rank 0 staged one whole tensor of the update."""

    name: str
    shm: str
    offset: int
    dtype: str
    shape: list[int]


def full_targets(worker: Any) -> dict[str, torch.Tensor]:
    """Stand-ins (``meta`` tensors) of the stage's weights as a trainer holds them: whole,
    each with its checkpoint shape and the live weight's dtype."""
    runner = worker.runner
    targets, shards = runner._load_targets
    rename = runner.family.rename(runner.model_config.part)
    whole: dict[str, tuple[int, ...]] = {}
    with open_files(checkpoint_files(worker.checkpoint)) as opened:
        for st in opened:
            for key, entry in st.entries.items():
                name = rename(key)
                if name is not None:
                    whole[name] = tuple(entry.shape)
    by_memory = {t.data_ptr(): whole[n] for n, t in targets.items() if n in whole}
    out = {}
    for name, target in targets.items():
        shape = whole.get(name) or by_memory.get(target.data_ptr())  # a tied weight
        if shape is None and (shards or {}).get(name) is None:
            shape = tuple(target.shape)
        if shape is not None:
            out[name] = torch.empty(shape, dtype=target.dtype, device="meta")
    return out


def slices_of(tensors: Mapping[str, torch.Tensor]) -> list[SyncSlice]:
    """Where each staged tensor lies in rank 0's shared staging."""
    out = []
    for name, tensor in tensors.items():
        place = locate(tensor)
        if place is None or not tensor.is_contiguous():
            raise InvalidRequestError(
                "update_info", f"tensor {name} is not in shared staging: the ranks cannot read it"
            )
        out.append(
            SyncSlice(name, place[0], place[1], dtype_name(tensor.dtype), list(tensor.shape))
        )
    return out


class RankWeights:
    """One rank's side of a synced update (see the module docstring)."""

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self._pending: dict[str, torch.Tensor] | None = None

    def _targets(self) -> dict[str, torch.Tensor]:
        """This rank's live weights, each narrowed to what its slice fills."""
        targets, shards = self.worker.runner._load_targets
        out = {}
        for name, dest in targets.items():
            shard = (shards or {}).get(name)
            if shard is not None and shard.dim < dest.dim():
                dest = dest.narrow(shard.dim, 0, min(shard.length, dest.shape[shard.dim]))
            out[name] = dest
        return out

    def prepare(self, whole: Mapping[str, torch.Tensor]) -> None:
        """Narrow each whole tensor to this rank's slice and check it fits; nothing copied."""
        if self.worker.arena.is_asleep(WEIGHTS):
            raise InvalidRequestError("weight_version", f"rank {self.worker.rank}: weights asleep")
        _, shards = self.worker.runner._load_targets
        targets, pending = self._targets(), {}
        for name, tensor in whole.items():
            shard = (shards or {}).get(name)
            if shard is not None:
                tensor = tensor.narrow(shard.dim, shard.start, shard.length)
            if name not in targets or targets[name].shape != tensor.shape:
                raise InvalidRequestError(
                    f"update_info.shapes.{name}", f"does not fit rank {self.worker.rank}'s slice"
                )
            pending[name] = tensor
        self._pending = pending

    def prepare_slices(self, slices: list[SyncSlice]) -> None:
        mapped: dict[str, torch.Tensor] = {}
        whole = {}
        for s in slices:
            if s.shm not in mapped:
                mapped[s.shm] = map_segment(s.shm)
            dtype = parse_dtype(s.dtype)
            count = dtype.itemsize * int(torch.Size(s.shape).numel())
            raw = mapped[s.shm][s.offset : s.offset + count]
            if raw.numel() != count:
                raise InvalidRequestError("update_info", f"tensor {s.name} lies past its segment")
            whole[s.name] = raw.view(dtype).view(s.shape)
        self.prepare(whole)

    def commit(self, version: str, apply: bool) -> Ack | None:
        """Apply what ``prepare`` narrowed (``apply``), or drop it."""
        pending, self._pending = self._pending, None
        if not apply:
            return None
        if pending is None:
            raise InvalidRequestError("session", "no prepared weight update on this rank")
        control: Any = self.worker.sleep_control
        targets: Callable[[], dict[str, torch.Tensor]] = self._targets
        ack: Ack = control.apply_synced(pending, targets, version)
        self.worker.clear_encoder_cache()
        return ack
