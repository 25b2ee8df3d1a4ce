"""Suite-wide: one intra-op thread for the in-process references. On 2 shared cores torch's default thread
pool spins against the ranks and other jobs and makes a tiny model 10-60x slower."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
