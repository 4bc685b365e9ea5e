"""Weight sync without disk through the engine client: vLLM's weight-transfer protocol per
stage (``init`` once, then ``start`` → ``update``* → ``finish`` per update), the stage's weights
checksum, and what a finished sync changes here (valid weights, the version responses carry,
what a restart must know)."""

from __future__ import annotations

import logging
from typing import Any

from omnistage.engine.control import StageControl
from omnistage.engine.events import log_weights
from omnistage.stage import control as ops
from omnistage.stage.control import Ack

logger = logging.getLogger(__name__)


class WeightSyncClient:
    def __init__(self, control: StageControl) -> None:
        self.control = control
        self.versions: dict[int, str] = {}  # stage id -> weight version of its last sync

    def _stage(self, stage_id: int) -> Any:
        (sid,) = self.control.check_stage_ids([stage_id], "stage_id")
        self.control.gate.check_alive(sid)
        return self.control.clients[sid]

    async def init(
        self, stage_id: int, backend: str = "nccl", init_info: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        op = ops.InitWeightTransfer(backend=backend, init_info=init_info or {})
        result: dict[str, Any] = await self._stage(stage_id).call(op)
        return result

    async def start(
        self, stage_id: int, update_info: dict[str, Any] | None = None
    ) -> dict[str, Any]:
        op = ops.StartWeightUpdate(update_info=update_info)
        result: dict[str, Any] = await self._stage(stage_id).call(op)
        return result

    async def update(self, stage_id: int, update_info: dict[str, Any]) -> dict[str, Any]:
        op = ops.ReceiveWeights(update_info=update_info)
        result: dict[str, Any] = await self._stage(stage_id).call(op)
        return result

    async def finish(self, stage_id: int, weight_version: str | int | None = None) -> list[Ack]:
        version = None if weight_version is None else str(weight_version)
        client = self._stage(stage_id)
        name = self.control.config.stages[stage_id].display_name
        try:
            acks: list[Ack] = await client.call(ops.FinishWeightUpdate(weight_version=version))
        except Exception as exc:
            log_weights(logger, "weight_sync", stage_id, name, exc, weight_version=version)
            raise
        ack = acks[0]
        log_weights(logger, "weight_sync", stage_id, name, ack, weight_version=version)
        if ack.status == "SUCCESS":
            self.control.gate.set_weights_valid(stage_id, True)
            if ack.metadata.weight_version:
                self.versions[stage_id] = ack.metadata.weight_version
        self.control.notify("update_weights", acks)
        return acks

    async def checksum(self, stage_id: int) -> str:
        return str(await self._stage(stage_id).call(ops.WeightsChecksum()))
