"""The physical baseline of a level-2 reload: reading the same checkpoint files from the page
cache into memory, with nothing else done — measured in the bench's process, in the same run.

Three readings of the same bytes, each a median over ``repeats`` after one warm-up read (which
also brings the files into the page cache):

- ``read_gbps``: a plain read — one stream (``preadv`` of 16 MiB pieces, what ``readinto``
  does) into memory that is already resident;
- ``read_threads_gbps``: the same on ``threads`` threads (what the stage's reload uses);
- ``fresh_read_gbps``: ``threads`` threads into memory released and mapped again just before
  (what a level-2 wake has: the kernel must hand out zeroed pages, faulted in by the reads).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from omnistage.memory import Arena
from omnistage.models.file_reader import FileSpan, read_spans

_TAG = "baseline"


def read_baselines(files: Sequence[Path], threads: int, repeats: int = 5) -> dict[str, float]:
    sizes = [os.path.getsize(f) for f in files]
    total = sum(sizes)
    arena = Arena("cpu")
    fds = [os.open(f, os.O_RDONLY) for f in files]
    try:
        dest = arena.empty((total,), torch.uint8, _TAG)
        dest.fill_(0)  # resident
        spans, offset = [], 0
        for fd, size, file in zip(fds, sizes, files, strict=True):
            spans.append(FileSpan(fd, 0, size, dest[offset : offset + size], str(file)))
            offset += size

        def gbps(n_threads: int, fresh: bool) -> float:
            times = []
            for _ in range(repeats + 1):
                if fresh:
                    arena.sleep(discard=[_TAG])
                    arena.wake(fill=[_TAG])
                start = time.perf_counter()
                read_spans(spans, n_threads)
                times.append(time.perf_counter() - start)
                arena.mark_valid(_TAG)
            return total / 1e9 / statistics.median(times[1:])

        return {
            "read_gbps": gbps(1, fresh=False),
            "read_threads_gbps": gbps(threads, fresh=False),
            "fresh_read_gbps": gbps(threads, fresh=True),
            "read_mib": total / 2**20,
        }
    finally:
        for fd in fds:
            os.close(fd)
        arena.close()
