"""The CUDA VMM backend on a real GPU; skipped where there is none."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

MiB = 1024 * 1024


def test_sleep_frees_device_memory_and_wake_is_bit_exact_at_same_address():
    from omnistage.memory import Arena

    arena = Arena("cuda:0")
    t = arena.empty((256 * MiB // 4,), torch.float32, "weights")
    t.copy_(torch.randn(t.shape, device="cuda"))
    expected, ptr = t.clone(), t.data_ptr()
    free_before, _ = torch.cuda.mem_get_info()
    report = arena.sleep(offload=["weights"])
    free_after, _ = torch.cuda.mem_get_info()
    assert free_after - free_before >= 0.95 * 256 * MiB
    assert report.freed_bytes >= 256 * MiB
    arena.wake()
    assert t.data_ptr() == ptr and torch.equal(t, expected)
    arena.sleep(discard=["weights"])
    arena.wake()
    assert not arena.is_valid("weights")
    arena.close()


def test_cuda_graph_replays_after_wake_without_recapture():
    from omnistage.memory import Arena

    arena = Arena("cuda:0")
    w = arena.empty((64, 64), torch.float32, "weights")
    x = arena.empty((8, 64), torch.float32, "kv_cache")
    w.copy_(torch.randn(64, 64, device="cuda"))
    x.copy_(torch.randn(8, 64, device="cuda"))
    torch.cuda.synchronize()
    static_out = torch.empty(8, 64, device="cuda")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.matmul(x, w, out=static_out)
        with torch.cuda.graph(graph):
            torch.matmul(x, w, out=static_out)
    graph.replay()
    expected = static_out.clone()
    arena.sleep(offload=["weights", "kv_cache"])
    arena.wake()
    static_out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, expected)
    arena.close()
