"""Checkpoint bytes read straight into destinations: direct on the host (threads taking whole
destination windows), staged through host buffers for a device, and checked reads."""

import os
import threading

import pytest
import torch
from safetensors.torch import save_file

from omnistage.errors import CheckpointError
from omnistage.memory import Arena
from omnistage.models import file_reader
from omnistage.models.file_reader import read_spans, read_staged
from omnistage.models.loader import SafetensorsFile, load_into


@pytest.fixture
def checkpoint(tmp_path):
    """Tensors of several sizes and dtypes, some larger than a read piece and a window."""
    torch.manual_seed(0)
    tensors = {
        "big": torch.randn(5 * 1024 * 1024 + 3),  # 20 MiB + 12 bytes: several pieces
        "half": torch.randn(4097, 33).half(),
        "ints": torch.randint(-(2**40), 2**40, (1000,), dtype=torch.int64),
        "flags": torch.rand(77) > 0.5,
        "tiny": torch.randn(1),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    return path, tensors


def arena_targets(tensors):
    arena = Arena("cpu")
    targets = {
        name: arena.empty(t.shape, t.dtype, "weights").fill_(0) for name, t in tensors.items()
    }
    return arena, targets


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_direct_reads_fill_arena_tensors_bit_exact(checkpoint, threads, monkeypatch):
    path, tensors = checkpoint
    monkeypatch.setattr(file_reader, "reader_threads", lambda: threads)
    monkeypatch.setattr(file_reader, "WINDOW_BYTES", 2 * 1024 * 1024)  # many windows
    monkeypatch.setattr(file_reader, "MIN_BYTES_PER_THREAD", 1)  # every reader takes part
    arena, targets = arena_targets(tensors)
    ptrs = {name: t.data_ptr() for name, t in targets.items()}
    report = load_into(targets, path)
    assert report.num_tensors == len(tensors)
    for name, t in targets.items():
        assert t.data_ptr() == ptrs[name] and torch.equal(t, tensors[name]), name
    arena.close()


def test_reads_into_fresh_memory_after_a_discard(checkpoint):
    path, tensors = checkpoint
    arena, targets = arena_targets(tensors)
    load_into(targets, path)
    arena.sleep(discard=["weights"])
    arena.wake(fill=["weights"])  # the reads fault the pages in
    load_into(targets, path)
    arena.mark_valid("weights")
    assert all(torch.equal(t, tensors[name]) for name, t in targets.items())
    arena.close()


@pytest.mark.parametrize("threads", [1, 2])
def test_staged_reads_equal_direct_ones(checkpoint, threads, monkeypatch):
    # The path a CUDA destination takes, run on the host: unpinned buffers, synchronous copies.
    path, tensors = checkpoint
    monkeypatch.setattr(file_reader, "PIECE_BYTES", 1024 * 1024)  # more pieces than slots
    targets = {name: torch.zeros_like(t) for name, t in tensors.items()}
    with SafetensorsFile(path) as st:
        spans = [st.span(name, targets[name], name) for name in tensors]
        read_staged([s for s in spans if s is not None], threads, pinned=False)
    for name, t in targets.items():
        assert torch.equal(t, tensors[name]), name


def test_converting_loads_still_copy_from_the_mapping(checkpoint):
    path, tensors = checkpoint
    targets = {"half": torch.zeros(4097, 33, dtype=torch.float32)}
    load_into(targets, path, strict=False, rename=lambda n: n if n == "half" else None)
    assert torch.equal(targets["half"], tensors["half"].float())


def test_a_file_that_shrank_after_its_check_is_an_error_not_a_crash(checkpoint, monkeypatch):
    path, tensors = checkpoint
    monkeypatch.setattr(file_reader, "MIN_BYTES_PER_THREAD", 1)  # the error comes from a helper
    monkeypatch.setattr(file_reader, "WINDOW_BYTES", 2 * 1024 * 1024)
    targets = {name: torch.zeros_like(t) for name, t in tensors.items()}
    with SafetensorsFile(path) as st:
        spans = [st.span(name, targets[name], name) for name in tensors]
        os.truncate(path, os.path.getsize(path) // 2)
        with pytest.raises(CheckpointError, match="ended .* bytes early"):
            read_spans([s for s in spans if s is not None], threads=2)


def test_the_file_stays_open_until_closed(checkpoint):
    path, _ = checkpoint
    st = SafetensorsFile(path)
    assert os.path.samestat(os.fstat(st.fd), os.stat(path))
    st.close()
    assert st.fd == -1
    st.close()  # twice is fine


def _reader_threads() -> set[int]:
    return {t.ident for t in threading.enumerate() if t.name.startswith("omnistage-read")}


def test_reader_helpers_are_kept_between_reads(checkpoint, monkeypatch):
    path, tensors = checkpoint
    monkeypatch.setattr(file_reader, "MIN_BYTES_PER_THREAD", 1)
    monkeypatch.setattr(file_reader, "WINDOW_BYTES", 2 * 1024 * 1024)
    targets = {name: torch.zeros_like(t) for name, t in tensors.items()}
    with SafetensorsFile(path) as st:
        spans = [s for s in (st.span(n, targets[n], n) for n in tensors) if s is not None]
        read_spans(spans, threads=3)
        helpers = _reader_threads()
        read_spans(spans, threads=3)
        assert helpers and _reader_threads() == helpers  # no thread started for the second
    assert all(torch.equal(t, tensors[name]) for name, t in targets.items())


def test_a_small_read_stays_on_the_calling_thread(checkpoint, monkeypatch):
    path, tensors = checkpoint

    def no_helpers():
        raise AssertionError("a read under MIN_BYTES_PER_THREAD per reader used helpers")

    monkeypatch.setattr(file_reader, "_helper_pool", no_helpers)
    targets = {name: torch.zeros_like(t) for name, t in tensors.items()}
    load_into(targets, path)  # ~21 MiB: under two readers' worth
    assert all(torch.equal(t, tensors[name]) for name, t in targets.items())
