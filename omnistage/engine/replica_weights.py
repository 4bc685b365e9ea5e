"""A trainer's weight transfer to a stage of several replicas: every replica takes the same
tensors. Each replica's rank 0 joins the trainer's group at a rank of its own (replica ``r``
at ``rank_offset + r``), or reads the same shared-memory tensors; a session is one id here
standing for each replica's own; ``finish`` answers every replica's ACKs, rolled up."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import msgspec

from omnistage import errors
from omnistage.engine.replica_parts import replica_acks, rolled_up
from omnistage.stage import control as ops
from omnistage.stage.control import Ack

TRANSFER_OPS = (
    ops.InitWeightTransfer,
    ops.StartWeightUpdate,
    ops.ReceiveWeights,
    ops.FinishWeightUpdate,
    ops.AbortWeightUpdate,
)


async def transfer(client: Any, op: ops.ControlOp) -> Any:
    """A weight-transfer step on every replica at once (a collective: each replica's
    rank 0 is a member of the trainer's group, replica ``r`` at rank ``rank_offset + r``);
    a session is one id here standing for each replica's own."""
    down = [i for i, r in enumerate(client.replicas) if r.is_dead]
    if down:
        raise errors.StageDeadError(client.stage_id, f"replicas {down} are down")
    each: list[ops.ControlOp] = [op] * len(client.replicas)
    if isinstance(op, ops.InitWeightTransfer) and op.backend == "nccl":
        each = ranked(client, op)
    elif isinstance(op, ops.StartWeightUpdate):
        if (op.update_info or {}).get("shared_staging"):
            raise errors.InvalidRequestError(
                "update_info.shared_staging", f"stage {client.stage_id} runs "
                f"{len(client.replicas)} replicas, each with staging of its own: send the "
                "tensors (ipc handles or the nccl group) instead"
            )  # fmt: skip
    elif isinstance(op, ops.ReceiveWeights | ops.FinishWeightUpdate | ops.AbortWeightUpdate):
        sessions = client._sessions.get(op.session) if op.session is not None else None
        if op.session is not None and sessions is None:
            raise errors.InvalidRequestError(
                "session", "no such update session (it ended, or another one began)"
            )
        if sessions is not None:
            each = [msgspec.structs.replace(op, session=own) for own in sessions]
    results = await asyncio.gather(
        *(r.call(o) for r, o in zip(client.replicas, each, strict=True)), return_exceptions=True
    )
    if isinstance(op, ops.FinishWeightUpdate):
        if all(isinstance(r, BaseException) for r in results):
            raise results[0]  # type: ignore[misc]
        acks: list[Ack] = []
        for index, result in enumerate(results):
            acks += replica_acks(client.stage_id, index, result)
        return rolled_up(acks)
    for result in results:
        if isinstance(result, BaseException):
            raise result
    if isinstance(op, ops.WeightsChecksum):
        sums = [str(r) for r in results]
        return sums[0] if len(set(sums)) == 1 else "replicas differ: " + ",".join(sums)
    first = results[0]
    if isinstance(op, ops.StartWeightUpdate) and isinstance(first, dict):
        own = [r.get("session") if isinstance(r, dict) else None for r in results]
        if all(isinstance(o, str) for o in own):
            session = secrets.token_hex(16)
            client._sessions[session] = [str(o) for o in own]
            while len(client._sessions) > 16:
                client._sessions.pop(next(iter(client._sessions)))
            first = {**first, "session": session}
    return first


def ranked(client: Any, op: ops.InitWeightTransfer) -> list[ops.ControlOp]:
    """Each replica's ``init`` in the trainer's group: its own rank after the first's."""
    info = dict(op.init_info or {})
    offset = info.get("rank_offset", 1)
    size = info.get("world_size", 2)
    if isinstance(offset, int) and isinstance(size, int):
        needed = offset + len(client.replicas)
        if size < needed:
            raise errors.InvalidRequestError(
                "init_info.world_size", f"is {size}; stage {client.stage_id}'s "
                f"{len(client.replicas)} replicas each join the group (ranks {offset} to "
                f"{needed - 1}): at least {needed}"
            )  # fmt: skip
        return [
            msgspec.structs.replace(op, init_info={**info, "rank_offset": offset + i})
            for i in range(len(client.replicas))
        ]
    return [op] * len(client.replicas)
