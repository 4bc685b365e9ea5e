"""Checkpoint bytes read straight into their destination tensors, the fewest copies possible.

A level-2 wake refills the weights from page-cached safetensors files. Copying out of a
memory mapping of the file costs a page fault per few pages of the mapping; instead each
span of the file is read with ``preadv`` into the destination's own memory — one copy, by
the kernel, out of the page cache — on several threads (``preadv`` runs without the GIL), and
the destination's fresh pages are faulted in by those same writes.

For a device destination (CUDA) the bytes go through a few pinned host buffers: reader threads
fill one while the device copies out of the others (``non_blocking``), so disk reads and
host-to-device copies overlap.

Every read is checked: a file that shrank since its header was validated reads short and
raises ``CheckpointError`` (where a memory mapping would have killed the process with
``SIGBUS``).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from omnistage.errors import CheckpointError

PIECE_BYTES = 16 * 1024 * 1024  # the most one preadv reads
WINDOW_BYTES = 16 * 1024 * 1024  # the unit of work of one thread: an aligned destination window
STAGING_SLOTS = 4  # pinned buffers of PIECE_BYTES each for a device destination
MAX_THREADS = 8
# Below this much per thread, more readers cost more than they gain: between small reads the
# threads take turns at the GIL and contend for the fresh pages they fault in. On a 2-core
# machine, 16 MiB of tensors took 7-8 ms on two readers, 4-7 ms on one; 122 MiB 27 ms on two,
# 51 ms on one.
MIN_BYTES_PER_THREAD = 32 * 1024 * 1024


@dataclass(frozen=True)
class FileSpan:
    """``nbytes`` bytes at ``offset`` of the open file ``fd``, for the contiguous ``dest``
    (whose bytes they are, in its dtype)."""

    fd: int
    offset: int
    nbytes: int
    dest: torch.Tensor
    name: str = ""


def reader_threads() -> int:
    """As many readers as the process computes with (a stage's share of the cores)."""
    return max(1, min(MAX_THREADS, torch.get_num_threads()))


def _pieces(spans: Sequence[FileSpan]) -> list[tuple[FileSpan, int, int]]:
    """``(span, start, stop)`` byte ranges of at most ``PIECE_BYTES``."""
    return [
        (span, start, min(start + PIECE_BYTES, span.nbytes))
        for span in spans
        for start in range(0, span.nbytes, PIECE_BYTES)
    ]


def _windows(spans: Sequence[FileSpan]) -> list[list[tuple[FileSpan, int, int]]]:
    """Host reads grouped by ``WINDOW_BYTES``-aligned windows of destination address space.

    Threads take whole windows, so no two of them write the same (huge) page: fresh pages
    are faulted in by one writer each instead of contended for."""
    windows: dict[int, list[tuple[FileSpan, int, int]]] = {}
    for span in spans:
        base = span.dest.data_ptr()
        start = 0
        while start < span.nbytes:
            window = (base + start) // WINDOW_BYTES
            stop = min(span.nbytes, (window + 1) * WINDOW_BYTES - base)
            windows.setdefault(window, []).append((span, start, stop))
            start = stop
    return [windows[w] for w in sorted(windows)]


def _read_exactly(span: FileSpan, start: int, into: memoryview) -> None:
    done, want = 0, len(into)
    while done < want:
        try:
            got = os.preadv(span.fd, [into[done:]], span.offset + start + done)
        except OSError as exc:
            raise CheckpointError(f"cannot read tensor {span.name}: {exc.strerror}") from exc
        if got == 0:
            raise CheckpointError(
                f"tensor {span.name}: the file ended {want - done} bytes early "
                "(it changed after it was checked)"
            )
        done += got


def _host_view(tensor: torch.Tensor, start: int, stop: int) -> memoryview:
    """A writable view of bytes ``[start, stop)`` of a contiguous CPU tensor's memory."""
    array = (ctypes.c_char * (stop - start)).from_address(tensor.data_ptr() + start)
    return memoryview(array).cast("B")


_helpers: ThreadPoolExecutor | None = None
_helpers_lock = threading.Lock()


def _helper_pool() -> ThreadPoolExecutor:
    """Reader threads kept for the process's life: starting threads for every read cost more
    than a small checkpoint's whole reload (~1 ms a thread on a busy 2-core machine)."""
    global _helpers
    with _helpers_lock:
        if _helpers is None:
            _helpers = ThreadPoolExecutor(MAX_THREADS - 1, thread_name_prefix="omnistage-read")
        return _helpers


def _run_threads(work: Callable[[Any], None], items: Sequence[Any], threads: int) -> None:
    """``work(item)`` for every item, by ``threads`` threads (the caller's and kept helpers)
    taking the next one in turn; the first error is raised once every thread has stopped."""
    threads = min(threads, len(items))
    if threads <= 1:
        for item in items:
            work(item)
        return
    lock = threading.Lock()
    position = iter(items)
    errors: list[BaseException] = []

    def worker() -> None:
        while not errors:
            with lock:
                item = next(position, None)
            if item is None:
                return
            try:
                work(item)
            except BaseException as exc:  # handed to the caller below
                errors.append(exc)

    helpers = [_helper_pool().submit(worker) for _ in range(threads - 1)]
    worker()
    for helper in helpers:
        helper.result()
    if errors:
        raise errors[0]


def read_spans(spans: Sequence[FileSpan], threads: int | None = None) -> int:
    """Read every span into its destination; returns the bytes read."""
    threads = reader_threads() if threads is None else threads
    host = [s for s in spans if s.dest.device.type == "cpu"]
    device = [s for s in spans if s.dest.device.type != "cpu"]

    def read_window(pieces: list[tuple[FileSpan, int, int]]) -> None:
        for span, start, stop in pieces:
            _read_exactly(span, start, _host_view(span.dest, start, stop))

    host_bytes = sum(s.nbytes for s in host)
    _run_threads(read_window, _windows(host), min(threads, host_bytes // MIN_BYTES_PER_THREAD))
    if device:
        read_staged(device, threads)
    return sum(s.nbytes for s in spans)


def read_staged(spans: Sequence[FileSpan], threads: int, pinned: bool | None = None) -> None:
    """Read spans into device (or any) destinations through ``STAGING_SLOTS`` host buffers:
    readers fill a buffer while earlier ones are copied to their destinations.

    ``pinned`` (default: for CUDA destinations) makes the buffers page-locked and the copies
    asynchronous; a buffer is refilled only after the copy out of it has completed.
    """
    pieces = _pieces(spans)
    if not pieces:
        return
    device = spans[0].dest.device
    pinned = device.type == "cuda" if pinned is None else pinned
    slots = min(STAGING_SLOTS, len(pieces))
    size = max(stop - start for _, start, stop in pieces)
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=pinned) for _ in range(slots)]
    copied: list[Any] = [None] * slots  # per slot: the event of the copy out of it
    pending: deque[tuple[Future[None], tuple[FileSpan, int, int], int]] = deque()

    def fill(piece: tuple[FileSpan, int, int], slot: int) -> None:
        span, start, stop = piece
        _read_exactly(span, start, _host_view(buffers[slot], 0, stop - start))

    def copy_oldest() -> None:
        future, (span, start, stop), slot = pending.popleft()
        future.result()
        flat = span.dest.reshape(-1).view(torch.uint8)
        flat[start:stop].copy_(buffers[slot][: stop - start], non_blocking=pinned)
        if pinned:
            event = torch.cuda.Event()
            event.record()
            copied[slot] = event

    with ThreadPoolExecutor(max(1, min(threads, slots)), "omnistage-stage-read") as pool:
        try:
            for i, piece in enumerate(pieces):
                slot = i % slots
                if len(pending) == slots:
                    copy_oldest()  # frees this slot's buffer (its copy is queued)
                if copied[slot] is not None:
                    copied[slot].synchronize()
                pending.append((pool.submit(fill, piece, slot), piece, slot))
            while pending:
                copy_oldest()
        finally:
            for future, _, _ in pending:
                future.cancel()
    if pinned:
        torch.cuda.current_stream(device).synchronize()
