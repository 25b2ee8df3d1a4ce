"""`srun -n 4 python pretrain_gpt2.py ...`: one SLURM task per rank, no torchrun. The ranks, world size and master
address come from SLURM's variables (megatron.config.launcher_env), and the run at (tp, pp, dp) = (2, 2, 1)
equals the same run under torchrun: the loss of every iteration as logged (6 decimals) and the saved weights bit
for bit."""
import os
import subprocess
import sys

import pytest

from tests.slurm.conftest import ROOT, assert_same_weights, logged_losses
from tests.training.runner import small_argv

pytestmark = pytest.mark.slurm
ITERS = 6


def _run(cmd, env, timeout=400) -> str:
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return log


def test_srun_one_task_per_rank_equals_torchrun(cluster, data, tmp_path):
    argv = small_argv(data, tp=2, pp=2, train_iters=ITERS, extra=["--log-interval", "1"])
    script = [sys.executable, "pretrain_gpt2.py", *argv]
    srun_log = _run(["srun", "--ntasks", "4", "--kill-on-bad-exit=1", *script, "--save", str(tmp_path / "srun")],
                    cluster)
    env = {k: v for k, v in cluster.items() if not k.startswith("SLURM_") or k == "SLURM_CONF"}
    torchrun_log = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
                         *script[1:], "--save", str(tmp_path / "torchrun")], env)
    assert "ranks: from SLURM's SLURM_PROCID/SLURM_NTASKS (srun): world size 4, 4 per node" in srun_log, srun_log
    assert "ranks: from the launcher's RANK/WORLD_SIZE (torchrun, deepspeed): world size 4" in torchrun_log
    assert "(tp, pp, dp) = (2, 2, 1)" in srun_log
    srun_losses, torchrun_losses = logged_losses(srun_log), logged_losses(torchrun_log)
    assert sorted(srun_losses) == list(range(1, ITERS + 1)), srun_log[-3000:]
    assert srun_losses == torchrun_losses
    assert_same_weights(str(tmp_path / "srun"), str(tmp_path / "torchrun"))
