"""The real one-node SLURM cluster of tests/slurm/cluster.sh (make test-slurm starts and stops it), and helpers
for its jobs: submit an examples/slurm script, wait for a state, read the losses a log prints, compare the
weights of two checkpoints bit for bit.

These tests are marked `slurm` and excluded from the default run; by hand:
    tests/slurm/cluster.sh start && SLURM_CONF=/tmp/megatron-slurm-cluster/slurm.conf pytest -m slurm tests/slurm
    tests/slurm/cluster.sh stop
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from typing import Dict, List, Optional

import pytest
import torch

from megatron.checkpointing.consolidated import read_consolidated
from megatron.checkpointing.files import checkpoint_folder, read_latest
from harness.example_data import build_data

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEFAULT_CONF = "/tmp/megatron-slurm-cluster/slurm.conf"
# a tiny model at (tp, pp, dp) = (1, 2, 1) on 2 ranks (2 shared cores), every iteration logged
# (examples/ds_pretrain_*.sh variables)
TINY = dict(NUM_LAYERS="2", HIDDEN="32", HEADS="4", SEQ_LEN="32", MICRO_BATCH="2", GAS="2", TP="1", PP="2",
            NPROC="2", LOG_INTERVAL="1", EVAL_INTERVAL="1000", EVAL_ITERS="1", SAVE_INTERVAL="1000", SAMPLES="0")
LOSS_LINE = re.compile(r"^iteration (\d+)/\d+ \|.*?\| loss ([0-9.]+) ", re.M)


def slurm_env(**extra: str) -> Dict[str, str]:
    """This process's environment with SLURM_CONF and the venv's python first on PATH (sbatch and srun pass
    the environment on to the job)."""
    env = dict(os.environ, SLURM_CONF=os.environ.get("SLURM_CONF", DEFAULT_CONF), PYTHON=sys.executable,
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""), OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT, REPO=ROOT)
    env.update(extra)
    return env


@pytest.fixture(scope="session")
def cluster() -> Dict[str, str]:
    """The running cluster's environment; an error saying how to start it when `sinfo` cannot reach it."""
    env = slurm_env()
    try:
        proc = subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
    except FileNotFoundError:
        proc = None
    if proc is None or proc.returncode != 0:
        pytest.fail("no SLURM cluster answers (SLURM_CONF=%s): start one with `tests/slurm/cluster.sh start`, or "
                    "run `make test-slurm`%s" % (env["SLURM_CONF"], "" if proc is None else ": " + proc.stderr))
    return env


@pytest.fixture(scope="session")
def data(tmp_path_factory) -> Dict[str, str]:
    return build_data(str(tmp_path_factory.mktemp("slurm_data")))


def data_env(data: Dict[str, str]) -> Dict[str, str]:
    return dict(DATA_PATH=data["data_prefix"], VOCAB_FILE=data["vocab"], MERGE_FILE=data["merges"])


def sbatch(script: str, env: Dict[str, str], output: str, *options: str, args: List[str] = ()) -> str:
    """Submit examples/slurm/`script` from the repository root; returns the job id."""
    cmd = ["sbatch", "--parsable", f"--output={output}", *options, os.path.join("examples", "slurm", script), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().split(";")[0]


def job_fields(job: str, env: Dict[str, str]) -> Dict[str, str]:
    """`scontrol show job` as a dict (JobState, ExitCode, Restarts, ...)."""
    out = subprocess.run(["scontrol", "-o", "show", "job", job], env=env, capture_output=True, text=True,
                         timeout=30).stdout
    return dict(field.split("=", 1) for field in out.split() if "=" in field)


def wait_for_state(job: str, env: Dict[str, str], states: tuple, timeout: float, log: Optional[str] = None) -> dict:
    """Poll until the job's state is one of `states`; the job's log is in the error after `timeout` s."""
    deadline = time.monotonic() + timeout
    fields: dict = {}
    while time.monotonic() < deadline:
        fields = job_fields(job, env)
        if fields.get("JobState") in states:
            return fields
        time.sleep(1)
    subprocess.run(["scancel", job], env=env, timeout=30)
    tail = read(log)[-4000:] if log else ""
    raise AssertionError(f"job {job} not {'/'.join(states)} after {timeout:.0f} s: {fields.get('JobState')}\n{tail}")


def wait_for_line(path: str, pattern: str, timeout: float, job: str, env: Dict[str, str]) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, read(path), re.M):
            return
        if job_fields(job, env).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            break
        time.sleep(0.2)
    raise AssertionError(f"no line /{pattern}/ in the log of job {job}:\n{read(path)[-4000:]}")


def read(path: str) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return ""


def logged_losses(log: str) -> Dict[int, str]:
    """Iteration -> the loss the log prints for it (as printed: 6 decimals); an iteration printed twice must
    print the same loss."""
    losses: Dict[int, str] = {}
    for iteration, loss in LOSS_LINE.findall(log):
        assert losses.setdefault(int(iteration), loss) == loss, f"iteration {iteration} logged twice, differently"
    return losses


def final_weights(save: str) -> Dict[str, torch.Tensor]:
    """The full (tp-merged) weights of the checkpoint `latest` names in `save`."""
    return read_consolidated(checkpoint_folder(save, read_latest(save)), with_optimizer=False).weights


def assert_same_weights(save_a: str, save_b: str) -> None:
    a, b = final_weights(save_a), final_weights(save_b)
    assert a.keys() == b.keys()
    different = [name for name in a if not torch.equal(a[name], b[name])]
    assert not different, f"weights differ between {save_a} and {save_b}: {different}"
