import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """One torch thread for each module (set before its pipelines' threads first compute):
    the reference's and our float sums then run in the same order, bit for bit."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
