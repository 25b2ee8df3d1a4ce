"""A rank lost mid-run under `torchrun --max-restarts 1`: torchrun restarts every rank, the run resumes from
`latest` by itself (--load = --save) and completes; every loss from the restored iteration on equals the
uninterrupted run's."""
import os
import re
import subprocess
import sys

import pytest

from megatron.logging_utils import LOSS_RECORD, recorded_losses
from pretrain_gpt2 import DEFAULTS as GPT_DEFAULTS, SPEC as GPT_SPEC
from harness.dist import run_distributed
from tests.training.runner import small_argv, train_losses

pytestmark = pytest.mark.long

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _torchrun(argv, kill_at: int, record: str) -> str:
    env = dict(os.environ, KILL_AT=str(kill_at), KILL_RANK="3", OMP_NUM_THREADS="1", PYTHONPATH=ROOT,
               **{LOSS_RECORD: record})
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--standalone", "--max-restarts",
           "1", "--monitor-interval", "0.5", "tests/training/kill_rank_entry.py", *argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


def _logged(log: str) -> list:
    """The iterations the log lines print, in order."""
    return [int(i) for i in re.findall(r"iteration (\d+)/8 \|", log)]


def test_lost_rank_restarts_and_resumes_exactly(gpt_data, tmp_path):
    def argv(save):
        return small_argv(gpt_data, pp=2, train_iters=8, extra=["--save", save, "--load", save, "--save-interval",
                                                                 "2", "--log-interval", "1", "--exit-signal-handler"])
    uninterrupted = run_distributed(train_losses, 4, argv(str(tmp_path / "a")), 4, GPT_SPEC, GPT_DEFAULTS,
                                    timeout=300)[-1]
    record = str(tmp_path / "losses.txt")
    log = _torchrun(argv(str(tmp_path / "b")), kill_at=6, record=record)
    assert "rank 3: killing itself at iteration 6" in log
    logged = _logged(log)  # attempt 1 logged 1..5; attempt 2 starts after the save at 4
    assert logged == [1, 2, 3, 4, 5, 5, 6, 7, 8], logged
    # every loss exactly (iteration 5, logged by both attempts, recorded the same twice: recorded_losses checks)
    assert recorded_losses(record) == dict(enumerate(uninterrupted, 1))
