"""A rank lost mid-run under `torchrun --max-restarts 1`: torchrun restarts every rank, the run resumes from
`latest` by itself (--load = --save) and completes; every loss from the restored iteration on equals the
uninterrupted run's."""
import os
import re
import subprocess
import sys

import pytest

from pretrain_gpt2 import DEFAULTS as GPT_DEFAULTS, SPEC as GPT_SPEC
from tests.dist import run_distributed
from tests.training.runner import small_argv, train_losses

pytestmark = pytest.mark.long

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torchrun(argv, kill_at: int) -> str:
    env = dict(os.environ, KILL_AT=str(kill_at), KILL_RANK="3", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--standalone", "--max-restarts",
           "1", "--monitor-interval", "0.5", "tests/training/kill_rank_entry.py", *argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


def _losses(log: str) -> list:
    return [(int(i), loss) for i, loss in re.findall(r"iteration (\d+)/8 \|.*?\| loss ([0-9.]+)", log)]


def test_lost_rank_restarts_and_resumes_exactly(gpt_data, tmp_path):
    def argv(save):
        return small_argv(gpt_data, pp=2, train_iters=8, extra=["--save", save, "--load", save, "--save-interval",
                                                                 "2", "--log-interval", "1", "--exit-signal-handler"])
    uninterrupted = run_distributed(train_losses, 4, argv(str(tmp_path / "a")), 4, GPT_SPEC, GPT_DEFAULTS,
                                    timeout=300)[-1]
    reference = [(i, f"{loss:.6f}") for i, loss in enumerate(uninterrupted, 1)]  # as the log line prints it
    log = _torchrun(argv(str(tmp_path / "b")), kill_at=6)
    assert "rank 3: killing itself at iteration 6" in log
    logged = _losses(log)
    restart = [i for i, _ in logged].index(5) + 1  # attempt 1 logged 1..5; attempt 2 starts after the save at 4
    assert [i for i, _ in logged[:restart]] == [1, 2, 3, 4, 5]
    assert [i for i, _ in logged[restart:]] == [5, 6, 7, 8], logged
    assert logged == reference[:5] + reference[4:]
