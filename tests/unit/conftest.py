import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """Tiny models gain nothing from a second thread, and on a busy CI machine OpenMP threads that spin-wait
    for each other make each step many times slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
