"""``EngineClient``: what the HTTP layer needs from an engine client (``AsyncOmni`` in the
server, a fake in tests).

The data routes use all of it. The control routes stay compatible with vLLM-Omni's engine
clients, which offer only part of it: they probe optional methods (``hasattr``) and answer
501 for what is missing.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

from omnistage.config import PipelineConfig
from omnistage.engine.admission import StageState
from omnistage.engine.outputs import OmniRequestOutput


class EngineClient(Protocol):
    config: PipelineConfig

    @property
    def num_stages(self) -> int: ...

    @property
    def sleep_mode_enabled(self) -> bool: ...

    def output_modalities(self) -> list[str]: ...

    def generate(
        self,
        prompt: str | dict[str, Any],
        sampling_params: dict[str, Any] | None = None,
        modalities: Sequence[str] | None = None,
        *,
        image_params: dict[str, Any] | None = None,
        talker_params: dict[str, Any] | None = None,
        audio_params: dict[str, Any] | None = None,
        request_id: str | None = None,
    ) -> AsyncIterator[OmniRequestOutput]: ...

    async def abort(self, request_id: str) -> None: ...

    async def sleep(
        self,
        stage_ids: Sequence[int],
        level: int = 2,
        mode: str = "abort",
        tags: Sequence[str] | None = None,
    ) -> list[dict[str, Any]]: ...

    async def wake_up(
        self,
        stage_ids: Sequence[int] | None = None,
        tags: Sequence[str] | None = None,
        reload: bool = True,
        resume: bool | None = None,
    ) -> list[dict[str, Any]]: ...

    async def stage_status(self) -> list[dict[str, Any]]: ...

    def stage_states(self) -> list[StageState]: ...

    def num_in_flight(self, stage_id: int) -> int: ...

    def dead_stage_ids(self) -> list[int]: ...

    def add_control_listener(
        self, listener: Callable[[str, list[dict[str, Any]]], None]
    ) -> None: ...

    async def init_weight_transfer(
        self,
        stage_id: int,
        backend: str = "nccl",
        init_info: dict[str, Any] | None = None,
        *,
        abort_open: bool = False,
    ) -> dict[str, Any]: ...

    async def start_weight_update(
        self,
        stage_id: int,
        update_info: dict[str, Any] | None = None,
        *,
        require_session: bool = False,
        abort_open: bool = False,
    ) -> dict[str, Any]: ...

    async def receive_weights(
        self, stage_id: int, update_info: dict[str, Any], *, session: str | None = None
    ) -> dict[str, Any]: ...

    async def finish_weight_update(
        self, stage_id: int, weight_version: str | int | None = None, *, session: str | None = None
    ) -> list[dict[str, Any]]: ...

    async def abort_weight_update(
        self, stage_id: int, *, session: str | None = None
    ) -> dict[str, Any]: ...

    async def weights_checksum(self, stage_id: int) -> str: ...

    def weight_version(self, stage_id: int = 0) -> str | None: ...

    async def reset_prefix_cache(self, stage_ids: Sequence[int] | None = None) -> list[int]: ...

    async def abort_requests(self, request_ids: Sequence[str]) -> None: ...
