"""``batch_invariant_kernels`` switches oneDNN off process-wide; overlapping users must agree."""

import threading

import torch

from omnistage.stage.diffusion.batch_invariance import batch_invariant_kernels

CPU = torch.device("cpu")


def test_onednn_is_off_inside_and_restored_after_an_exception():
    previous = torch.backends.mkldnn.enabled
    try:
        with batch_invariant_kernels(CPU):
            assert not torch.backends.mkldnn.enabled
            raise KeyError("boom")
    except KeyError:
        pass
    assert torch.backends.mkldnn.enabled == previous


def test_overlapping_blocks_on_two_threads_keep_onednn_off_and_restore_it():
    previous = torch.backends.mkldnn.enabled
    first_inside, second_inside, first_left = (threading.Event() for _ in range(3))
    seen: dict[str, bool] = {}

    def first() -> None:
        with batch_invariant_kernels(CPU):
            first_inside.set()
            second_inside.wait(timeout=5)
        first_left.set()

    def second() -> None:
        first_inside.wait()
        with batch_invariant_kernels(CPU):
            second_inside.set()
            first_left.wait(timeout=5)
            seen["enabled_inside"] = torch.backends.mkldnn.enabled

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    after = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = previous  # type: ignore[assignment]
    assert seen == {"enabled_inside": False}  # the second model still ran with oneDNN off
    assert after == previous
