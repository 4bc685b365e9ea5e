"""Weight sync without disk through the engine client: vLLM's weight-transfer protocol per
stage (``init`` once, then ``start`` → ``update``* → ``finish`` per update, one session at a
time: see ``omnistage.stage.weights.sync``), the stage's weights checksum, and what a finished
sync changes here (valid weights, the version responses carry, what a restart must know).

The version responses carry is the one of the weights serving: a finish that applied weights
without a version clears it (the weights are no longer the labelled ones), a refused one
leaves it."""

from __future__ import annotations

import logging
from typing import Any

from omnistage.engine.control import StageControl
from omnistage.engine.events import log_weights
from omnistage.engine.replica_parts import replicas_together
from omnistage.rl.bounds import check_weight_version
from omnistage.stage import control as ops
from omnistage.stage.control import Ack

logger = logging.getLogger(__name__)


class WeightSyncClient:
    def __init__(self, control: StageControl) -> None:
        self.control = control
        self.versions: dict[int, str] = {}  # stage id -> weight version of its serving sync
        control.add_listener(self._on_control)

    def _on_control(self, operation: str, acks: list[Ack]) -> None:
        """A checkpoint loaded from disk (``update_weights``) replaces the trainer's weights:
        their version no longer names what serves."""
        if operation != "update_weights":
            return
        for ack in acks:
            if ack.status == "SUCCESS" and ack.rank == 0 and not ack.metadata.weight_version:
                self.versions.pop(ack.stage_id, None)

    def _stage(self, stage_id: int) -> Any:
        (sid,) = self.control.check_stage_ids([stage_id], "stage_id")
        self.control.gate.check_alive(sid)
        return self.control.clients[sid]

    async def init(
        self,
        stage_id: int,
        backend: str = "nccl",
        init_info: dict[str, Any] | None = None,
        *,
        abort_open: bool = False,
    ) -> dict[str, Any]:
        op = ops.InitWeightTransfer(
            backend=backend, init_info=init_info or {}, abort_open=abort_open
        )
        result: dict[str, Any] = await self._stage(stage_id).call(op)
        return result

    async def start(
        self,
        stage_id: int,
        update_info: dict[str, Any] | None = None,
        *,
        require_session: bool = False,
        abort_open: bool = False,
    ) -> dict[str, Any]:
        """Open an update session; the reply's ``session`` is what update and finish name."""
        op = ops.StartWeightUpdate(
            update_info=update_info, require_session=require_session, abort_open=abort_open
        )
        result: dict[str, Any] = await self._stage(stage_id).call(op)
        return result

    async def update(
        self, stage_id: int, update_info: dict[str, Any], *, session: str | None = None
    ) -> dict[str, Any]:
        op = ops.ReceiveWeights(update_info=update_info, session=session)
        result: dict[str, Any] = await self._stage(stage_id).call(op)
        return result

    async def finish(
        self, stage_id: int, weight_version: str | int | None = None, *, session: str | None = None
    ) -> list[Ack]:
        # Checked here, before any stage sees it: a bad version leaves the session open.
        version = None if weight_version is None else check_weight_version(weight_version)
        op = ops.FinishWeightUpdate(weight_version=version, session=session)
        client = self._stage(stage_id)
        name = self.control.config.stages[stage_id].display_name
        control = self.control
        try:
            async with replicas_together(control.gate, control.config, stage_id):
                acks: list[Ack] = await client.call(op)
        except Exception as exc:
            log_weights(logger, "weight_sync", stage_id, name, exc, weight_version=version)
            raise
        ack = acks[0]
        log_weights(logger, "weight_sync", stage_id, name, ack, weight_version=version)
        if ack.status == "SUCCESS":
            self.control.gate.set_weights_valid(stage_id, True)
            if ack.metadata.weight_version:
                self.versions[stage_id] = ack.metadata.weight_version
            else:
                self.versions.pop(stage_id, None)
        self.control.notify("update_weights", acks)
        return acks

    async def abort(self, stage_id: int, *, session: str | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self._stage(stage_id).call(
            ops.AbortWeightUpdate(session=session)
        )
        return result

    async def checksum(self, stage_id: int) -> str:
        return str(await self._stage(stage_id).call(ops.WeightsChecksum()))
