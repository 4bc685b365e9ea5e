"""STUB of vllm.distributed.parallel_state: the test process never joins a process group,
so tearing one down is a no-op. _TP is swapped by the init_fake_tp_group fixture."""

_TP = None


def destroy_model_parallel() -> None:
    return None


def destroy_distributed_environment() -> None:
    return None
