"""The tagged memory arena: tensors at fixed addresses whose memory can sleep and wake.

Every tensor the arena hands out is a view into a *region* owned by a backend. Regions are
grouped by tag (``weights``, ``kv_cache``, ...). Sleeping a tag releases the physical memory
behind its regions — optionally after copying the contents to a host backup — while the
virtual addresses stay reserved, so tensors, module parameters and captured CUDA graphs keep
pointing at the right place. Waking maps fresh memory at the same addresses and copies the
backup back, bit for bit.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from omnistage.memory.backend import ArenaError, Backend, Region, round_up
from omnistage.memory.host import HostBackend

ALIGNMENT = 256  # bytes; enough for any dtype and for vectorised kernels


class ArenaWakeError(ArenaError):
    """Waking failed half-way; the arena rolled back and the named tags are still asleep."""

    def __init__(self, message: str, report: WakeReport) -> None:
        super().__init__(message)
        self.report = report


@dataclass(frozen=True)
class TagStats:
    reserved_bytes: int
    resident_bytes: int
    backup_bytes: int
    is_asleep: bool = False
    is_valid: bool = True


@dataclass
class SleepReport:
    offloaded_tags: list[str] = field(default_factory=list)
    discarded_tags: list[str] = field(default_factory=list)
    skipped_tags: list[str] = field(default_factory=list)
    freed_bytes: int = 0
    backup_bytes: int = 0
    latency_ms: float = 0.0

    @property
    def is_noop(self) -> bool:
        return not self.offloaded_tags and not self.discarded_tags


@dataclass
class WakeReport:
    restored_tags: list[str] = field(default_factory=list)
    invalid_tags: list[str] = field(default_factory=list)  # woken without contents (discarded)
    skipped_tags: list[str] = field(default_factory=list)
    restored_bytes: int = 0
    mapped_bytes: int = 0
    latency_ms: float = 0.0
    error: str | None = None

    @property
    def is_noop(self) -> bool:
        return not self.restored_tags and not self.invalid_tags


@dataclass
class _Tag:
    regions: list[Region] = field(default_factory=list)
    is_asleep: bool = False
    is_offloaded: bool = False  # asleep with contents in host backups
    is_valid: bool = True  # contents meaningful (False after a discard until refilled)


def _default_backend(device: torch.device) -> Backend:
    if device.type == "cpu":
        return HostBackend()
    if device.type == "cuda":
        from omnistage.memory.cuda_vmm import CudaVmmBackend

        return CudaVmmBackend(device)
    raise ArenaError(f"unsupported arena device {device!s}; use 'cpu' or 'cuda:N'")


class Arena:
    """Tagged, sleepable device memory for one stage (one rank)."""

    def __init__(self, device: str | torch.device = "cpu", backend: Backend | None = None) -> None:
        self.device = torch.device(device)
        self.backend = backend if backend is not None else _default_backend(self.device)
        self._tags: dict[str, _Tag] = {}
        self._lock = threading.RLock()
        self._closed = False

    # -- allocation ---------------------------------------------------------------------

    def _allocate(
        self, nbytes: int, tag: str, *, on_touch: bool = False
    ) -> tuple[Region, torch.Tensor]:
        if self._closed:
            raise ArenaError("arena is closed")
        state = self._tags.setdefault(tag, _Tag())
        if state.is_asleep:
            raise ArenaError(f"cannot allocate under tag {tag!r}: it is asleep")
        region = self.backend.allocate(nbytes, on_touch=on_touch)
        state.regions.append(region)
        return region, self.backend.as_tensor(region)

    def empty(
        self, shape: Iterable[int] | int, dtype: torch.dtype, tag: str, *, on_touch: bool = False
    ) -> torch.Tensor:
        """An uninitialised tensor living in the arena under ``tag``.

        ``on_touch``: after its memory was discarded, a wake maps it back without faulting
        its pages in; they come in as they are first touched (on the host, in 4 KiB pages).
        For a cache used from its first blocks on (the KV cache): a wake then costs nothing
        for it, and a request pays only for the few pages it touches."""
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        numel = 1
        for dim in shape:
            numel *= dim
        itemsize = torch.empty((), dtype=dtype).element_size()
        with self._lock:
            _, flat = self._allocate(numel * itemsize, tag, on_touch=on_touch)
        return flat[: numel * itemsize].view(dtype).view(shape)

    def adopt(self, module: nn.Module, tag: str = "weights") -> int:
        """Move a module's parameters and persistent buffers into one arena region.

        Works on modules built on the ``meta`` device (the memory is then uninitialised and
        the loader fills it). Non-persistent buffers (rotary tables and the like) are derived
        data, not checkpoint contents, and stay where they are. Shared (tied) tensors are
        packed once. Returns the bytes adopted.
        """
        tensors: list[torch.Tensor] = []
        seen: set[int] = set()
        for param in module.parameters():
            if id(param) not in seen:
                seen.add(id(param))
                tensors.append(param)
        for mod in module.modules():
            non_persistent: set[str] = getattr(mod, "_non_persistent_buffers_set", set())
            for name, buf in mod._buffers.items():
                if buf is None or name in non_persistent or id(buf) in seen:
                    continue
                seen.add(id(buf))
                tensors.append(buf)
        offsets = []
        total = 0
        for t in tensors:
            total = round_up(total, ALIGNMENT)
            offsets.append(total)
            total += t.numel() * t.element_size()
        if total == 0:
            return 0
        with self._lock:
            _, flat = self._allocate(total, tag)
        replacements: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for t, offset in zip(tensors, offsets, strict=True):
                nbytes = t.numel() * t.element_size()
                view = flat[offset : offset + nbytes].view(t.dtype).view(t.shape)
                if t.device.type == "meta":
                    # A meta tensor cannot take new data in place: swap the object everywhere.
                    if isinstance(t, nn.Parameter):
                        view = nn.Parameter(view, requires_grad=t.requires_grad)
                    replacements[id(t)] = view
                else:
                    view.copy_(t)
                    t.data = view
        if replacements:
            for mod in module.modules():
                for slots in (mod._parameters, mod._buffers):
                    for name, old in slots.items():
                        if old is not None and id(old) in replacements:
                            slots[name] = replacements[id(old)]  # type: ignore[assignment]
        return total

    # -- sleep / wake -------------------------------------------------------------------

    def sleep(self, offload: Iterable[str] = (), discard: Iterable[str] = ()) -> SleepReport:
        """Release the memory of the named tags; ``offload`` tags keep a host copy first.

        Asleep tags are skipped (reported), except that discarding an offloaded tag drops its
        host copy (sleeping deeper). Unknown tags raise ``ArenaError``.
        """
        offload, discard = list(dict.fromkeys(offload)), list(dict.fromkeys(discard))
        both = set(offload) & set(discard)
        if both:
            raise ArenaError(f"tags both offloaded and discarded: {sorted(both)}")
        start = time.perf_counter()
        report = SleepReport()
        with self._lock:
            self._check_tags([*offload, *discard])
            self.backend.synchronize()
            for tag in offload:
                state = self._tags[tag]
                if state.is_asleep:
                    report.skipped_tags.append(tag)
                    continue
                report.backup_bytes += self._save_all(tag, state)
                report.freed_bytes += self._unmap_all(state)
                state.is_asleep, state.is_offloaded = True, True
                report.offloaded_tags.append(tag)
            for tag in discard:
                state = self._tags[tag]
                if state.is_asleep and not state.is_offloaded:
                    report.skipped_tags.append(tag)
                    continue
                if state.is_asleep:  # deeper: drop the host copy
                    for region in state.regions:
                        self.backend.drop_host_backup(region)
                else:
                    report.freed_bytes += self._unmap_all(state)
                state.is_asleep, state.is_offloaded, state.is_valid = True, False, False
                report.discarded_tags.append(tag)
        report.latency_ms = (time.perf_counter() - start) * 1e3
        return report

    def wake(self, tags: Iterable[str] | None = None, *, fill: Iterable[str] = ()) -> WakeReport:
        """Map memory back for the named tags (all asleep tags by default).

        Offloaded tags get their contents back; discarded tags come back with undefined
        contents and ``is_valid(tag)`` False until ``mark_valid``. ``fill`` names discarded
        tags the caller is about to write in full (a reload): their fresh memory is faulted
        in by those writes instead of up front. On failure everything this call mapped is
        released again (restored contents go back to their backups), the tags stay asleep,
        and ``ArenaWakeError`` carries the report; a later wake can retry.
        """
        start = time.perf_counter()
        report = WakeReport()
        lazy = set(fill)
        with self._lock:
            names = list(self._tags) if tags is None else list(dict.fromkeys(tags))
            self._check_tags(names)
            mapped: list[tuple[Region, bool]] = []  # (region, restored from its backup)
            try:
                for tag in names:
                    state = self._tags[tag]
                    if not state.is_asleep:
                        report.skipped_tags.append(tag)
                        continue
                    for region in state.regions:
                        if state.is_offloaded:
                            self.backend.restore(region)
                            report.restored_bytes += region.nbytes
                        else:
                            self.backend.map(region, populate=tag not in lazy)
                        mapped.append((region, state.is_offloaded))
                        report.mapped_bytes += region.nbytes
                    (report.restored_tags if state.is_offloaded else report.invalid_tags).append(
                        tag
                    )
                self.backend.synchronize()
            except Exception as exc:
                for region, restored in reversed(mapped):
                    with contextlib.suppress(Exception):  # keep rolling back the rest
                        if restored:
                            self.backend.unrestore(region)
                        else:
                            self.backend.unmap(region)
                report.error = f"{type(exc).__name__}: {exc}"
                report.restored_tags.clear()
                report.invalid_tags.clear()
                report.latency_ms = (time.perf_counter() - start) * 1e3
                raise ArenaWakeError(f"wake failed and was rolled back: {exc}", report) from exc
            for tag in [*report.restored_tags, *report.invalid_tags]:
                state = self._tags[tag]
                if state.is_offloaded:
                    for region in state.regions:
                        if region.host_backup is not None:
                            self.backend.release_host_backup(region.host_backup)
                state.is_asleep, state.is_offloaded = False, False
        report.latency_ms = (time.perf_counter() - start) * 1e3
        return report

    def _save_all(self, tag: str, state: _Tag) -> int:
        """Put every region of an awake tag into its host backup; all or none: on failure the
        regions saved are put back (``ArenaError``; the tag stays awake) — or, if even that
        fails, the tag is left asleep with its contents lost, the one consistent state."""
        saved: list[Region] = []
        try:
            for region in state.regions:
                self.backend.save(region)
                saved.append(region)
            self.backend.synchronize()
        except Exception as exc:
            try:
                for region in reversed(saved):
                    self.backend.unsave(region)
            except Exception:
                with contextlib.suppress(Exception):
                    self._unmap_all(state)
                state.is_asleep, state.is_offloaded, state.is_valid = True, False, False
                raise ArenaError(
                    f"offloading {tag!r} failed ({exc}) and so did putting it back: "
                    "it is asleep with its contents lost"
                ) from exc
            raise ArenaError(f"offloading {tag!r} failed and was rolled back: {exc}") from exc
        return sum(region.nbytes for region in saved)

    def _unmap_all(self, state: _Tag) -> int:
        freed = 0
        try:
            for region in state.regions:
                if region.is_mapped:
                    self.backend.unmap(region)
                    freed += region.nbytes
        except Exception:
            # Part of the tag is gone: the only consistent state left is "asleep, contents
            # lost" (a wake maps everything back and the weights are reloaded).
            state.is_asleep, state.is_offloaded, state.is_valid = True, False, False
            raise
        return freed

    def _check_tags(self, names: Iterable[str]) -> None:
        unknown = [t for t in names if t not in self._tags]
        if unknown:
            raise ArenaError(f"unknown arena tags {unknown}; known tags: {sorted(self._tags)}")

    # -- state --------------------------------------------------------------------------

    @property
    def tags(self) -> list[str]:
        return list(self._tags)

    def is_asleep(self, tag: str) -> bool:
        self._check_tags([tag])
        return self._tags[tag].is_asleep

    def is_valid(self, tag: str) -> bool:
        """False while a tag's contents are undefined (discarded and not yet refilled)."""
        self._check_tags([tag])
        state = self._tags[tag]
        return state.is_valid and not state.is_asleep

    def mark_valid(self, tag: str) -> None:
        """Declare a woken tag's contents meaningful again (after a reload or weight update)."""
        with self._lock:
            self._check_tags([tag])
            state = self._tags[tag]
            if state.is_asleep:
                raise ArenaError(f"tag {tag!r} is asleep; wake it before refilling it")
            state.is_valid = True

    def reserved_bytes(self, tag: str) -> int:
        """Bytes the tag's regions span, asleep or awake."""
        with self._lock:
            self._check_tags([tag])
            return sum(r.nbytes for r in self._tags[tag].regions)

    def backup_bytes(self) -> int:
        """Bytes held in host backups of offloaded tags."""
        with self._lock:
            return sum(r.nbytes for s in self._tags.values() if s.is_offloaded for r in s.regions)

    def stats(self) -> dict[str, TagStats]:
        """Per tag: reserved bytes, bytes backed by memory now (on the host, only the pages an
        on-touch tensor has used since its last wake), backups, state."""
        with self._lock:
            return {
                tag: TagStats(
                    reserved_bytes=sum(r.nbytes for r in s.regions),
                    resident_bytes=sum(self.backend.resident_bytes(r) for r in s.regions),
                    backup_bytes=sum(r.nbytes for r in s.regions if s.is_offloaded),
                    is_asleep=s.is_asleep,
                    is_valid=s.is_valid,
                )
                for tag, s in self._tags.items()
            }

    def close(self) -> None:
        """Free every region. Tensors that still view arena memory must not be used after."""
        with self._lock:
            if self._closed:
                return
            self.backend.synchronize()
            for state in self._tags.values():
                for region in state.regions:
                    self.backend.free(region)
                    region.host_backup = None
            self._tags.clear()
            self._closed = True

    def __enter__(self) -> Arena:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
