"""The corpus of the fault tests (tests/conftest.py's `gpt_data`, copied for each test: the example script's split
caches index maps beside it) and the uninterrupted run of harness/faults/script.py's layout that every interrupted
run is compared with."""
import pytest

from harness.example_data import own_copy
from harness.faults.script import ITERS, run_script, script_env


@pytest.fixture
def data(gpt_data, tmp_path) -> dict:
    """The corpus copied for one test (its index maps, built by its runs, stay its own)."""
    return own_copy(gpt_data, tmp_path)


@pytest.fixture(scope="session")
def reference(gpt_data, tmp_path_factory) -> dict:
    """{iteration: loss} of the uninterrupted run."""
    root = tmp_path_factory.mktemp("faults_reference")
    run = run_script(script_env(own_copy(gpt_data, root), str(root / "work")))
    assert run.rc == 0, run.log[-4000:]
    logged = run.losses
    assert sorted(logged) == list(range(1, ITERS + 1)), run.log[-4000:]
    return logged
