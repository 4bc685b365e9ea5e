"""Reads into CUDA tensors through pinned staging buffers (reads overlapping the
host-to-device copies): bit-exact, also into the CUDA arena after a level-2 sleep."""

import pytest
import torch
from safetensors.torch import save_file

from omnistage.models import file_reader
from omnistage.models.loader import load_into

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_staged_reads_fill_cuda_tensors_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(file_reader, "PIECE_BYTES", 4 * 1024 * 1024)  # more pieces than slots
    torch.manual_seed(0)
    tensors = {
        "big": torch.randn(9 * 1024 * 1024 + 5),
        "half": torch.randn(333, 77).half(),
        "ints": torch.arange(1000, dtype=torch.int64),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    targets = {name: torch.zeros_like(t, device="cuda") for name, t in tensors.items()}
    load_into(targets, path)
    for name, t in targets.items():
        assert torch.equal(t.cpu(), tensors[name]), name


def test_reload_into_the_cuda_arena_after_a_level_2_sleep(tmp_path):
    from omnistage.memory import Arena

    torch.manual_seed(1)
    tensors = {"w": torch.randn(4096, 1024), "b": torch.randn(1024)}
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    arena = Arena("cuda:0")
    targets = {n: arena.empty(t.shape, t.dtype, "weights") for n, t in tensors.items()}
    load_into(targets, path)
    ptrs = {n: t.data_ptr() for n, t in targets.items()}
    arena.sleep(discard=["weights"])
    arena.wake(fill=["weights"])
    load_into(targets, path)
    arena.mark_valid("weights")
    for name, t in targets.items():
        assert t.data_ptr() == ptrs[name] and torch.equal(t.cpu(), tensors[name]), name
    arena.close()
