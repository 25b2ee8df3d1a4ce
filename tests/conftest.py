"""Suite-wide: one intra-op thread for the in-process references. On 2 shared cores torch's default thread
pool spins against the ranks and other jobs and makes a tiny model 10-60x slower. And the example script's small
corpus (`gpt_data`), built once per session for every folder that trains on it.

Under pytest-xdist (make test runs two workers) each worker gets its own MASTER_PORT, below the ephemeral range:
the example scripts default to 29500, and two launches at once on one port would meet each other."""
import os

import pytest
import torch

from harness.example_data import build_data

_WORKER = os.environ.get("PYTEST_XDIST_WORKER", "")  # gw0, gw1, ...
if _WORKER.startswith("gw") and _WORKER[2:].isdigit():
    os.environ["MASTER_PORT"] = str(29600 + 10 * int(_WORKER[2:]))


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def gpt_data(tmp_path_factory) -> dict:
    return build_data(str(tmp_path_factory.mktemp("gpt_data")))
