"""Checkpoint bytes read straight into destinations: direct on the host (threads taking whole
destination windows), staged through host buffers for a device, and checked reads."""

import os

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


def test_a_file_that_shrank_after_its_check_is_an_error_not_a_crash(checkpoint):
    path, tensors = checkpoint
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
