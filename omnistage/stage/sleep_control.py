"""Sleep, wake and weight updates of one rank's arena, with honest ACKs.

Shared by every engine kind: the engine decides what happens to requests (pause, abort,
drain, preempt); this object decides what happens to memory, keeps track of whether the
weights are valid, and measures what was really freed. Level 1 offloads ``weights`` to host
memory and discards ``kv_cache``; level 2 discards everything and a later wake reloads the
weights into the same addresses by replaying every weight source the stage has taken (see
``docs/control-plane.md``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from omnistage.errors import CheckpointError, InvalidRequestError, WeightsInvalidError
from omnistage.memory import Arena, ArenaError, ArenaWakeError, device_used_bytes
from omnistage.stage.control import SYNC_PREFIX, Ack, make_ack
from omnistage.stage.vocabulary import KV_CACHE, WEIGHTS, check_tags
from omnistage.stage.weights.checks import copy_all

__all__ = ["KV_CACHE", "WEIGHTS", "CheckpointSource", "SleepController", "make_ack"]

# ``load(path, strict=..., check_finite=...)``: copy a checkpoint into the weights in place.
LoadWeights = Callable[..., Any]


class WeightSource(Protocol):
    """Somewhere weights came from, replayable by a level-2 reload or a restart."""

    @property
    def description(self) -> str: ...

    def load(self, load_weights: LoadWeights, *, strict: bool, check_finite: bool) -> int:
        """Copy the weights in; returns the bytes copied."""
        ...


@dataclasses.dataclass(frozen=True)
class CheckpointSource:
    """A safetensors file or checkpoint folder on disk."""

    path: Path

    @property
    def description(self) -> str:
        return str(self.path)

    def load(self, load_weights: LoadWeights, *, strict: bool, check_finite: bool) -> int:
        loaded = load_weights(self.path, strict=strict, check_finite=check_finite)
        return int(getattr(loaded, "num_bytes", loaded) or 0)  # a LoadReport or a count


@dataclasses.dataclass(frozen=True)
class SyncedSource:
    """Weights a trainer pushed (``weight_version``), kept in host memory so that a level-2
    reload can replay them. Not replayable by a new process: ``tensors`` is then ``None``."""

    version: str
    tensors: Mapping[str, torch.Tensor] | None
    targets: Callable[[], Mapping[str, torch.Tensor]] | None = None

    @property
    def description(self) -> str:
        return f"{SYNC_PREFIX}{self.version}"

    def load(self, load_weights: LoadWeights, *, strict: bool, check_finite: bool) -> int:
        if self.tensors is None or self.targets is None:
            raise CheckpointError(
                f"weights version {self.version!r} came from a trainer and left with the process "
                "that held them; wake with reload=false and push them again"
            )
        targets = self.targets()
        if strict:
            missing = self.missing()
            if missing:
                raise CheckpointError(
                    f"a weight sync onto discarded weights must carry all of them; missing {missing[:8]}"
                )
        with torch.no_grad():
            copy_all([(targets[name], tensor) for name, tensor in self.tensors.items()])
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def missing(self) -> list[str]:
        """Weights this source does not carry (tied weights count once)."""
        if self.tensors is None or self.targets is None:
            return []
        targets = self.targets()
        held = {t.data_ptr() for name, t in targets.items() if name in self.tensors}
        return [n for n, t in targets.items() if t.data_ptr() not in held]


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 3) if nbytes and seconds > 0 else 0.0


def checkpoint_source(path: str | Path, field: str = "path") -> CheckpointSource:
    """A ``CheckpointSource`` for an operator-given path, or ``InvalidRequestError`` naming
    ``field`` (the path must exist and be a regular file or a folder)."""
    if not isinstance(path, str | Path) or not str(path):
        raise InvalidRequestError(field, "must be a non-empty path")
    source = Path(path)
    try:
        if not (source.is_file() or source.is_dir()):
            raise InvalidRequestError(field, f"no such file or folder: {str(source)[:256]}")
    except (OSError, ValueError) as exc:  # name too long, NUL byte, permission
        raise InvalidRequestError(field, f"cannot use {str(source)[:256]!r}: {exc}") from None
    return CheckpointSource(source)


class SleepController:
    """Owns the sleep state of one rank's arena.

    ``load_weights(path, strict=, check_finite=)`` copies a checkpoint (a folder or a
    safetensors file) into the existing weight tensors in place, raising ``CheckpointError``
    on a mismatch (and on missing tensors when ``strict``); it serves level-2 reloads and
    weight updates.
    """

    def __init__(
        self,
        arena: Arena,
        stage_id: int,
        checkpoint: str | Path,
        load_weights: LoadWeights,
        rank: int = 0,
    ) -> None:
        self.arena = arena
        self.stage_id = stage_id
        self.rank = rank
        self._load_weights = load_weights
        # Every source the current weights came from, oldest first: a level-2 reload replays
        # them so the stage comes back with exactly the weights it served before.
        self._weight_sources: list[WeightSource] = [CheckpointSource(Path(checkpoint))]
        self.level = 0

    # -- queries ------------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return any(self.arena.is_asleep(t) for t in self.arena.tags)

    @property
    def sleeping_tags(self) -> list[str]:
        return [t for t in self.arena.tags if self.arena.is_asleep(t)]

    @property
    def weight_tags(self) -> list[str]:
        """The arena's tags that hold weights: ``weights``, or a stage's component tags
        (a diffusion pipeline's text encoders, transformer and VAE sleep apart)."""
        return [t for t in self.arena.tags if t != KV_CACHE]

    @property
    def weights_valid(self) -> bool:
        tags = self.weight_tags
        return bool(tags) and all(self.arena.is_valid(t) for t in tags)

    def _weights_asleep(self) -> bool:
        return any(self.arena.is_asleep(t) for t in self.weight_tags)

    @property
    def weight_sources(self) -> list[str]:
        return [s.description for s in self._weight_sources]

    def check_can_generate(self) -> None:
        """Raise ``WeightsInvalidError`` unless the weights are awake and meaningful."""
        if not self.weights_valid:
            raise WeightsInvalidError(self.stage_id)

    def memory_stats(self) -> dict[str, Any]:
        """Per tag and in all: ``reserved_bytes`` (its address range), ``resident_bytes``
        (measured: the pages in memory), ``released_bytes`` (what a sleep gave back: the
        reserved bytes not resident of a tag that is asleep; an awake tag releases nothing,
        its pages not touched yet are simply not resident) and ``backup_bytes`` (its host
        copy). The console and ``omnistage:stage_released_bytes`` read these."""
        stats = self.arena.stats()
        tags = {}
        for tag, s in stats.items():
            released = max(0, s.reserved_bytes - s.resident_bytes) if s.is_asleep else 0
            tags[tag] = {**dataclasses.asdict(s), "released_bytes": released}
        return {
            "tags": tags,
            "reserved_bytes": sum(s.reserved_bytes for s in stats.values()),
            "resident_bytes": sum(s.resident_bytes for s in stats.values()),
            "released_bytes": sum(t["released_bytes"] for t in tags.values()),
            "backup_bytes": sum(s.backup_bytes for s in stats.values()),
        }

    def _resolve_tags(self, tags: Iterable[str] | None) -> list[str]:
        return check_tags(tags, self.arena.tags) or self.arena.tags

    def _ack(self, status: str, start: float, before: int, **fields: Any) -> Ack:
        return make_ack(
            self.stage_id,
            status=status,
            rank=self.rank,
            latency_ms=(time.perf_counter() - start) * 1e3,
            resident_bytes_before=before,
            resident_bytes_after=device_used_bytes(self.arena.device),
            sleeping_tags=self.sleeping_tags,
            weights_valid=self.weights_valid,
            **fields,
        )

    # -- transitions --------------------------------------------------------------------

    def sleep(self, level: int, tags: Sequence[str] | None = None, **metadata: Any) -> Ack:
        """Release memory for ``level`` (1 or 2; 0 touches no memory) and return the ACK."""
        chosen = self._resolve_tags(tags)
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
            return self._ack(
                "ERROR", start, before, error_msg=f"sleep failed: {exc}", level=level,
                tags=chosen, **metadata,
            )  # fmt: skip
        if level >= 1 and self.arena.device.type == "cuda":
            # Activations the stage ran with sit in torch's caching allocator, outside the
            # arena: hand them back too, or the memory is not really free for others.
            torch.cuda.empty_cache()
        if level >= 1 and not report.is_noop:
            self.level = max(self.level, level)
        status = "SKIPPED" if level >= 1 and report.is_noop else "SUCCESS"
        ack = self._ack(
            status,
            start,
            before,
            error_msg="already asleep" if status == "SKIPPED" else None,
            level=level,
            tags=[*report.offloaded_tags, *report.discarded_tags] if level else [],
            host_backup_bytes=self.arena.backup_bytes(),
            **metadata,
        )
        ack.freed_bytes = max(0, before - ack.metadata.resident_bytes_after)
        ack.metadata.gbps = _gbps(report.backup_bytes, report.latency_ms / 1e3)
        return ack

    def wake_up(
        self, tags: Sequence[str] | None = None, reload: bool = True, **metadata: Any
    ) -> Ack:
        """Map memory back; a discarded ``weights`` tag is reloaded from its sources unless
        ``reload`` is False, in which case the weights stay invalid until ``update_weights``
        (or a later wake with ``reload``). A failed reload puts back to sleep what this call
        woke and answers an ``ERROR`` ACK, so that a later wake can retry."""
        chosen = self._resolve_tags(tags)
        woken_from = self.level
        before = device_used_bytes(self.arena.device)
        start = time.perf_counter()
        # Discarded weights about to be reloaded get their pages faulted in by the reload.
        weight_tags = [t for t in chosen if t in self.weight_tags]
        fill = weight_tags if reload else []
        try:
            report = self.arena.wake(chosen, fill=fill)
        except ArenaWakeError as exc:
            return self._ack(
                "ERROR", start, before, error_msg=str(exc), level=self.level, tags=chosen,
                **metadata,
            )  # fmt: skip
        # Weights woken without contents now, or earlier with reload=False, are reloaded.
        invalid = [t for t in weight_tags if not self.arena.is_valid(t)]
        needs_reload = reload and bool(invalid)
        reload_gbps = 0.0
        if needs_reload:
            try:
                reload_start = time.perf_counter()
                reloaded = self.reload(invalid)
                reload_gbps = _gbps(reloaded, time.perf_counter() - reload_start)
            except Exception as exc:
                # Back to asleep, so that the stage is reported sleeping and a wake can retry.
                self.arena.sleep(discard=report.invalid_tags)
                return self._ack(
                    "ERROR",
                    start,
                    before,
                    error_msg=f"reloading the weights failed: {type(exc).__name__}: {exc}",
                    level=self.level,
                    tags=chosen,
                    **metadata,
                )
        for tag in report.invalid_tags:
            if tag not in self.weight_tags:
                self.arena.mark_valid(tag)  # caches are reset by their engine, contents unused
        restored = report.restored_bytes
        if needs_reload:
            restored += sum(self.arena.reserved_bytes(t) for t in invalid)
        if not self.is_sleeping:
            self.level = 0
        is_noop = report.is_noop and not needs_reload
        ack = self._ack(
            "SKIPPED" if is_noop else "SUCCESS",
            start,
            before,
            error_msg="not asleep" if is_noop else None,
            level=woken_from,
            tags=[*report.restored_tags, *report.invalid_tags],
            restored_bytes=restored,
            reload_gbps=reload_gbps,
            **metadata,
        )
        ack.metadata.gbps = _gbps(restored, ack.metadata.latency_ms / 1e3)
        return ack

    def reload(self, tags: Sequence[str] | None = None) -> int:
        """Refill the (awake) weights from every source they came from, oldest first;
        returns the bytes read. ``tags``: the weight tags being refilled (all by default);
        the worker's ``load_weights`` writes only into awake tags, and only into the
        invalid ones while any is (the others keep serving untouched)."""
        nbytes = 0
        for i, source in enumerate(self._weight_sources):
            nbytes += source.load(self._load_weights, strict=i == 0, check_finite=False)
        for tag in self.weight_tags if tags is None else tags:
            self.arena.mark_valid(tag)
        return nbytes

    def adopt_history(self, sources: Sequence[str], *, load: bool) -> None:
        """Take over the weight history of a previous process of this stage (a restart).

        With ``load`` (the checkpoint is already loaded) the sources it lacks are applied
        now; without, they wait for the reload of the next wake."""
        if not sources:
            return
        history: list[WeightSource] = [
            SyncedSource(p.removeprefix(SYNC_PREFIX), None)
            if p.startswith(SYNC_PREFIX)
            else CheckpointSource(Path(p))
            for p in sources
        ]
        if load:
            missing = history[1:] if history[0] == self._weight_sources[0] else history
            for source in missing:
                source.load(self._load_weights, strict=False, check_finite=False)
        self._weight_sources = list(history)

    def update_weights(self, path: str | Path, check_finite: bool = True) -> Ack:
        """Load ``path`` (safetensors file or folder) into the awake weights, in place.

        Every tensor is checked (names, shapes and, with ``check_finite``, NaN/Inf) before
        the first byte is copied: a bad source raises ``InvalidRequestError`` naming ``path``
        and the old weights keep serving.
        """
        source = checkpoint_source(path)
        if self._weights_asleep():
            raise InvalidRequestError(
                "path",
                "weights are asleep; wake them first (wake_up(tags=['weights'], reload=False))",
            )
        start = time.perf_counter()
        try:
            self._apply(source, check_finite=check_finite)
        except CheckpointError as exc:
            raise InvalidRequestError("path", str(exc)) from exc
        nbytes = sum(self.arena.reserved_bytes(t) for t in self.weight_tags)
        return self._ack(
            "SUCCESS", start, 0, restored_bytes=nbytes, tags=[WEIGHTS],
            weight_sources=self.weight_sources,
        )  # fmt: skip

    def apply_synced(
        self,
        tensors: dict[str, torch.Tensor],
        targets: Callable[[], Mapping[str, torch.Tensor]],
        version: str,
    ) -> Ack:
        """Copy checked tensors a trainer pushed into the awake weights, in place."""
        if self._weights_asleep():
            raise InvalidRequestError(
                "weight_version",
                "weights are asleep; wake them first (wake_up(tags=['weights'], reload=False))",
            )
        start = time.perf_counter()
        try:
            self._apply(SyncedSource(version, tensors, targets), check_finite=False)
        except CheckpointError as exc:
            raise InvalidRequestError("update_info", str(exc)) from exc
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        return self._ack(
            "SUCCESS", start, 0, restored_bytes=nbytes, tags=[WEIGHTS],
            weight_sources=self.weight_sources, weight_version=version,
        )  # fmt: skip

    def _apply(self, source: WeightSource, check_finite: bool) -> None:
        # Invalid weights need a complete checkpoint, which then replaces the history; valid
        # ones may take a partial update, replayed on top of the history by a later reload.
        # A complete sync replaces the history too: each one holds the weights in host memory.
        is_complete = not self.weights_valid or (
            isinstance(source, SyncedSource) and not source.missing()
        )
        source.load(self._load_weights, strict=is_complete, check_finite=check_finite)
        if is_complete:
            self._weight_sources = [source]
        else:
            self._weight_sources.append(source)
        for tag in self.weight_tags:
            self.arena.mark_valid(tag)
