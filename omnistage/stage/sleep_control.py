"""Sleep, wake and weight updates of one stage's arena, with honest ACKs.

Shared by every engine kind: the engine decides what happens to requests (pause, abort,
drain, preempt); this object decides what happens to memory, keeps track of whether the
weights are valid, and measures what was really freed. Levels follow SPEC §1: level 1
offloads ``weights`` to host memory and discards ``kv_cache``; level 2 discards everything
and a later wake reloads the weights from disk into the same addresses.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

from omnistage.errors import InvalidRequestError, WeightsInvalidError
from omnistage.memory import Arena, ArenaError, ArenaWakeError, device_used_bytes

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
SLEEP_LEVELS = (0, 1, 2)
SLEEP_MODES = ("abort", "wait", "keep")

_task_ids = itertools.count(1)


def make_ack(
    stage_id: int,
    *,
    status: str = "SUCCESS",
    rank: int = 0,
    freed_bytes: int = 0,
    error_msg: str | None = None,
    **metadata: Any,
) -> dict[str, Any]:
    """An ACK shaped like vLLM-Omni's ``OmniACK`` with omnistage's metadata."""
    meta: dict[str, Any] = {
        "level": None,
        "mode": None,
        "tags": [],
        "latency_ms": 0.0,
        "cuda_graph_recalled": False,
        "host_backup_bytes": 0,
        "restored_bytes": 0,
        "resident_bytes_before": 0,
        "resident_bytes_after": 0,
        "aborted": 0,
        "preempted": 0,
    }
    meta.update(metadata)
    return {
        "task_id": f"omni-{stage_id}-{next(_task_ids)}",
        "status": status,
        "stage_id": stage_id,
        "rank": rank,
        "freed_bytes": int(freed_bytes),
        "error_msg": error_msg,
        "metadata": meta,
    }


class SleepController:
    """Owns the sleep state of one stage's arena.

    ``load_weights(path, strict)`` must copy a checkpoint (a folder or a safetensors file)
    into the stage's existing weight tensors in place, raising on a mismatch (and on missing
    tensors when ``strict``); it serves level-2 reloads and weight updates.
    """

    def __init__(
        self,
        arena: Arena,
        stage_id: int,
        checkpoint: str | Path,
        load_weights: Callable[[Path, bool], Any],
        rank: int = 0,
    ) -> None:
        self.arena = arena
        self.stage_id = stage_id
        self.rank = rank
        self._load_weights = load_weights
        # Every source the current weights came from, oldest first: a level-2 reload replays
        # them so the stage comes back with exactly the weights it served before.
        self._weight_sources: list[Path] = [Path(checkpoint)]
        self.level = 0

    # -- queries ------------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return any(self.arena.is_asleep(t) for t in self.arena.tags)

    @property
    def sleeping_tags(self) -> list[str]:
        return [t for t in self.arena.tags if self.arena.is_asleep(t)]

    @property
    def weights_valid(self) -> bool:
        return self.arena.has_tag(WEIGHTS) and self.arena.is_valid(WEIGHTS)

    def check_can_generate(self) -> None:
        """Raise ``WeightsInvalidError`` unless the weights are awake and meaningful."""
        if not self.weights_valid:
            raise WeightsInvalidError(self.stage_id)

    def memory_stats(self) -> dict[str, Any]:
        stats = self.arena.stats()
        return {
            "tags": {tag: dataclasses.asdict(s) for tag, s in stats.items()},
            "reserved_bytes": sum(s.reserved_bytes for s in stats.values()),
            "resident_bytes": sum(s.resident_bytes for s in stats.values()),
            "backup_bytes": sum(s.backup_bytes for s in stats.values()),
        }

    def _resolve_tags(self, tags: Iterable[str] | None, field: str) -> list[str]:
        known = self.arena.tags
        if tags is None:
            return known
        chosen = list(dict.fromkeys(tags))
        unknown = [t for t in chosen if t not in known]
        if unknown:
            raise InvalidRequestError(field, f"unknown tags {unknown}; this stage has {known}")
        return chosen

    # -- transitions --------------------------------------------------------------------

    def sleep(
        self, level: int, tags: Sequence[str] | None = None, **metadata: Any
    ) -> dict[str, Any]:
        """Release memory for ``level`` (1 or 2; 0 touches no memory) and return the ACK."""
        if level not in SLEEP_LEVELS:
            raise InvalidRequestError("level", f"must be one of {SLEEP_LEVELS}, got {level!r}")
        chosen = self._resolve_tags(tags, "tags")
        before = device_used_bytes(self.arena.device)
        start = time.perf_counter()
        offload: list[str] = []
        discard: list[str] = []
        if level >= 1:
            for tag in chosen:
                (offload if level == 1 and tag != KV_CACHE else discard).append(tag)
        try:
            report = self.arena.sleep(offload=offload, discard=discard)
        except ArenaError as exc:
            # Reported, not raised: ``sleeping_tags`` says what the failure left asleep.
            if self.is_sleeping:
                self.level = 2  # whatever went down lost its contents
            return make_ack(
                self.stage_id,
                status="ERROR",
                rank=self.rank,
                error_msg=f"sleep failed: {exc}",
                level=level,
                tags=chosen,
                latency_ms=(time.perf_counter() - start) * 1e3,
                resident_bytes_before=before,
                resident_bytes_after=device_used_bytes(self.arena.device),
                sleeping_tags=self.sleeping_tags,
                **metadata,
            )
        if level >= 1 and self.arena.device.type == "cuda":
            # Activations the stage ran with sit in torch's caching allocator, outside the
            # arena: hand them back too, or the memory is not really free for others.
            torch.cuda.empty_cache()
        after = device_used_bytes(self.arena.device)
        if level >= 1 and not report.is_noop:
            self.level = max(self.level, level)
        status = "SKIPPED" if level >= 1 and report.is_noop else "SUCCESS"
        return make_ack(
            self.stage_id,
            status=status,
            rank=self.rank,
            freed_bytes=max(0, before - after),
            error_msg="already asleep" if status == "SKIPPED" else None,
            level=level,
            tags=[*report.offloaded_tags, *report.discarded_tags] if level else [],
            latency_ms=(time.perf_counter() - start) * 1e3,
            host_backup_bytes=sum(s.backup_bytes for s in self.arena.stats().values()),
            resident_bytes_before=before,
            resident_bytes_after=after,
            sleeping_tags=self.sleeping_tags,
            **metadata,
        )

    def wake_up(
        self, tags: Sequence[str] | None = None, reload: bool = True, **metadata: Any
    ) -> dict[str, Any]:
        """Map memory back; a discarded ``weights`` tag is reloaded from disk unless
        ``reload`` is False, in which case the weights stay invalid until ``update_weights``
        (or a later wake with ``reload``). A failed reload puts back to sleep what this call
        woke and answers an ``ERROR`` ACK, so that a later wake can retry."""
        chosen = self._resolve_tags(tags, "tags")
        woken_from = self.level
        before = device_used_bytes(self.arena.device)
        start = time.perf_counter()
        try:
            report = self.arena.wake(chosen)
        except ArenaWakeError as exc:
            return make_ack(
                self.stage_id,
                status="ERROR",
                rank=self.rank,
                error_msg=str(exc),
                level=self.level,
                tags=chosen,
                latency_ms=(time.perf_counter() - start) * 1e3,
                resident_bytes_before=before,
                resident_bytes_after=device_used_bytes(self.arena.device),
                **metadata,
            )
        # Weights woken without contents now, or earlier with reload=False, are reloaded.
        needs_reload = reload and WEIGHTS in chosen and not self.weights_valid
        if needs_reload:
            try:
                self._reload()
            except Exception as exc:
                # Back to asleep, so that the stage is reported sleeping and a wake can retry.
                self.arena.sleep(discard=report.invalid_tags)
                return make_ack(
                    self.stage_id,
                    status="ERROR",
                    rank=self.rank,
                    error_msg=f"reloading the weights failed: {type(exc).__name__}: {exc}",
                    level=self.level,
                    tags=chosen,
                    latency_ms=(time.perf_counter() - start) * 1e3,
                    resident_bytes_before=before,
                    resident_bytes_after=device_used_bytes(self.arena.device),
                    weights_valid=self.weights_valid,
                    sleeping_tags=self.sleeping_tags,
                    **metadata,
                )
        for tag in report.invalid_tags:
            if tag != WEIGHTS:
                self.arena.mark_valid(tag)  # caches are reset by their engine, contents unused
        restored = report.restored_bytes
        if needs_reload:
            restored += self.arena.stats()[WEIGHTS].reserved_bytes
        if not self.is_sleeping:
            self.level = 0
        after = device_used_bytes(self.arena.device)
        is_noop = report.is_noop and not needs_reload
        return make_ack(
            self.stage_id,
            status="SKIPPED" if is_noop else "SUCCESS",
            rank=self.rank,
            error_msg="not asleep" if is_noop else None,
            level=woken_from,
            tags=[*report.restored_tags, *report.invalid_tags],
            latency_ms=(time.perf_counter() - start) * 1e3,
            restored_bytes=restored,
            resident_bytes_before=before,
            resident_bytes_after=after,
            weights_valid=self.weights_valid,
            sleeping_tags=self.sleeping_tags,
            **metadata,
        )

    def _reload(self) -> None:
        for i, source in enumerate(self._weight_sources):
            self._load_weights(source, i == 0)
        self.arena.mark_valid(WEIGHTS)

    def update_weights(self, path: str | Path) -> dict[str, Any]:
        """Load ``path`` (safetensors file or folder) into the awake weights, in place."""
        source = Path(path)
        if not source.exists():
            raise InvalidRequestError("path", f"no such file or folder: {source}")
        if self.arena.is_asleep(WEIGHTS):
            raise InvalidRequestError(
                "path",
                "weights are asleep; wake them first (wake_up(tags=['weights'], reload=False))",
            )
        start = time.perf_counter()
        # Invalid weights need a complete checkpoint, which then replaces the history; valid
        # ones may take a partial update, replayed on top of the history by a later reload.
        is_complete = not self.weights_valid
        self._load_weights(source, is_complete)
        if is_complete:
            self._weight_sources = [source]
        else:
            self._weight_sources.append(source)
        self.arena.mark_valid(WEIGHTS)
        nbytes = self.arena.stats()[WEIGHTS].reserved_bytes
        return make_ack(
            self.stage_id,
            rank=self.rank,
            latency_ms=(time.perf_counter() - start) * 1e3,
            restored_bytes=nbytes,
            tags=[WEIGHTS],
            weights_valid=True,
        )
