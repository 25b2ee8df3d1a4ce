"""Suite-wide: one intra-op thread for the in-process references. On 2 shared cores torch's default thread
pool spins against the ranks and other jobs and makes a tiny model 10-60x slower. And the example script's small
corpus (`gpt_data`), built once per session for every folder that trains on it."""
import pytest
import torch

from harness.example_data import build_data


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def gpt_data(tmp_path_factory) -> dict:
    return build_data(str(tmp_path_factory.mktemp("gpt_data")))
