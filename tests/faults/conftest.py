"""The corpus of the fault tests (its own copy: the example script's split caches index maps beside it) and the
uninterrupted run of harness/faults/script.py's layout that every interrupted run is compared with."""
import pytest

from harness.faults.script import ITERS, run_script, script_env
from harness.example_data import build_data, own_copy


@pytest.fixture(scope="session")
def faults_data(tmp_path_factory) -> dict:
    return build_data(str(tmp_path_factory.mktemp("faults_data")))


@pytest.fixture
def data(faults_data, tmp_path) -> dict:
    """The corpus copied for one test (its index maps, built by its runs, stay its own)."""
    return own_copy(faults_data, tmp_path)


@pytest.fixture(scope="session")
def reference(faults_data, tmp_path_factory) -> dict:
    """{iteration: loss} of the uninterrupted run."""
    root = tmp_path_factory.mktemp("faults_reference")
    run = run_script(script_env(own_copy(faults_data, root), str(root / "work")))
    assert run.rc == 0, run.log[-4000:]
    logged = run.losses
    assert sorted(logged) == list(range(1, ITERS + 1)), run.log[-4000:]
    return logged
