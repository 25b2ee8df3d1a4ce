"""The sbatch scripts of examples/slurm on the real cluster, with a tiny GPT-2 at (tp, pp, dp) = (1, 2, 1):

- gpt2_torchrun.sbatch (one task per node running torchrun) completes; t5_srun.sbatch (one task per rank) too.
- Preemption: `scancel --signal=TERM` to the ranks of gpt2_srun.sbatch, and `scancel --batch --signal=USR1` to
  the batch shell of gpt2_torchrun.sbatch (which forwards it to the training workers, not to torchrun), in the
  middle of the run: the ranks save at the interrupted iteration and exit 0, the job requeues itself
  (`scontrol requeue`), and the requeued job resumes from that checkpoint and finishes with the losses of the
  uninterrupted run at every iteration (as logged, 6 decimals) and the same final weights, bit for bit.
- The time limit without `--signal`, in both styles: SLURM's own SIGTERM to every process of the job; the ranks
  save in KillWait's 30 s, and the next job resumes (its final weights bit for bit).

SLURM holds a requeued job for AuthInfo's cred_expire before it may start again (120 s by default); the test
cluster sets 10 s, so the requeued job starts on its own (releasing it earlier with `scontrol update
StartTime=now` can start it while its previous credential is still revoked, and the launch fails).
"""
import json
import os
import re
import subprocess

import pytest

from harness.faults.script import INJECT
from tests.slurm.conftest import (ROOT, TINY, assert_same_weights, data_env, job_fields, logged_losses, read,
                                  sbatch, wait_for_line, wait_for_state)

pytestmark = pytest.mark.slurm
ITERS = 20
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")
SRUN_STYLE = ["--ntasks-per-node=2"]  # the scripts ask for 8 tasks per node; (1, 2, 1) needs 2


def _gpt2_env(cluster, data, work_dir, **extra):
    return dict(cluster, **TINY, **data_env(data), TRAIN_ITERS=str(ITERS), WORK_DIR=str(work_dir), **extra)


def _assert_completed(job, env, log_path, restarts=0):
    fields = wait_for_state(job, env, DONE, timeout=400, log=log_path)
    log = read(log_path)
    assert (fields["JobState"], fields["ExitCode"], fields["Restarts"]) == ("COMPLETED", "0:0", str(restarts)), \
        f"{fields['JobState']} {fields['ExitCode']} restarts {fields['Restarts']}\n{log[-4000:]}"
    assert "test loss at the end of training" in log, log[-4000:]
    return log


@pytest.fixture(scope="module")
def uninterrupted(cluster, data, tmp_path_factory):
    """gpt2_torchrun.sbatch run to its end: (its log, its checkpoint directory)."""
    work = tmp_path_factory.mktemp("uninterrupted")
    env = _gpt2_env(cluster, data, work)
    job = sbatch("gpt2_torchrun.sbatch", env, str(work / "job.out"))
    log = _assert_completed(job, env, str(work / "job.out"))
    return log, str(work / "checkpoints")


def test_torchrun_per_node_style_completes(uninterrupted):
    log, save = uninterrupted
    assert "--ntasks-per-node 1" in log and "-m megatron.training.torchrun --nnodes 1 --nproc_per_node 2" in log, log
    assert "ranks: from the launcher's RANK/WORLD_SIZE (torchrun, deepspeed): world size 2" in log
    assert sorted(logged_losses(log)) == list(range(1, ITERS + 1))
    assert open(os.path.join(save, "latest")).read().strip() == f"iter_{ITERS:07d}"
    assert "requeueing" not in log


def test_t5_one_task_per_rank_completes(cluster, data, tmp_path):
    env = dict(cluster, **TINY, DATA_PATH=data["data_prefix"], TRAIN_ITERS="2", WORK_DIR=str(tmp_path), FFN="64",
               ENC_LEN="32", DEC_LEN="16", VOCAB_EXTRA_IDS="8")
    bpe = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", data["vocab"], "--merge-file", data["merges"]]
    job = sbatch("t5_srun.sbatch", env, str(tmp_path / "job.out"), *SRUN_STYLE, args=bpe)
    log = _assert_completed(job, env, str(tmp_path / "job.out"))
    assert "ranks: from SLURM's SLURM_PROCID/SLURM_NTASKS (srun): world size 2, 2 per node" in log, log
    assert "T5: tp=1, pp=2, 2 iterations" in log and sorted(logged_losses(log)) == [1, 2]


@pytest.mark.parametrize("script,options,scancel", [
    ("gpt2_srun.sbatch", SRUN_STYLE, ["--signal=TERM"]),
    ("gpt2_torchrun.sbatch", [], ["--batch", "--signal=USR1"]),
], ids=["srun-TERM", "torchrun-USR1"])
def test_preempted_job_requeues_and_resumes_bit_for_bit(cluster, data, tmp_path, uninterrupted, script, options,
                                                        scancel):
    env = _gpt2_env(cluster, data, tmp_path)
    log_path = str(tmp_path / "job.out")
    job = sbatch(script, env, log_path, *options)
    wait_for_line(log_path, r"^iteration 3/%d " % ITERS, timeout=300, job=job, env=env)
    subprocess.run(["scancel", *scancel, job], env=env, check=True, timeout=30)
    fields = wait_for_state(job, env, ("PENDING",) + DONE, timeout=300, log=log_path)
    log = read(log_path)
    signal_name = scancel[-1].split("=")[1]
    stopped = re.search(rf"^exiting at iteration (\d+) of {ITERS}: received SIG{signal_name} ", log, re.M)
    assert fields["JobState"] == "PENDING" and stopped, f"{fields['JobState']}\n{log[-4000:]}"
    iteration = int(stopped.group(1))
    assert iteration < ITERS
    assert f"requeueing job {job}" in log
    assert open(tmp_path / "checkpoints" / "latest").read().strip() == f"iter_{iteration:07d}"

    log = _assert_completed(job, env, log_path, restarts=1)
    assert re.search(rf"^loaded checkpoint \S+iter_{iteration:07d}: iteration {iteration},", log, re.M), log[-4000:]
    reference_log, reference_save = uninterrupted
    assert logged_losses(log) == logged_losses(reference_log)
    assert_same_weights(str(tmp_path / "checkpoints"), reference_save)
    assert job_fields(job, env)["Restarts"] == "1"


def _without_signal(script: str, folder) -> str:
    """A copy of examples/slurm/`script` without its `#SBATCH --signal` line: a job nobody warns before its end."""
    with open(os.path.join(ROOT, "examples", "slurm", script)) as f:
        lines = [line for line in f if not line.startswith("#SBATCH --signal")]
    path = os.path.join(str(folder), script.replace(".sbatch", "_no_signal.sbatch"))
    with open(path, "w") as f:
        f.writelines(lines)
    return path


@pytest.mark.parametrize("script,options", [("gpt2_srun.sbatch", SRUN_STYLE), ("gpt2_torchrun.sbatch", [])],
                         ids=["srun", "torchrun"])
def test_time_limit_without_signal_saves_and_resumes_bit_for_bit(cluster, data, tmp_path, uninterrupted, script,
                                                                 options):
    """SLURM ends the job at its time limit (1 minute, no --signal) with SIGTERM to every process of the job, the
    batch shell, the example script, its log filters, srun, torchrun and the ranks, and SIGKILL KillWait (30 s)
    later: the ranks save at the current iteration in between (each iteration sleeps 6 s here: tests/faults/
    plan.py). A second job resumes there and ends with the uninterrupted run's losses and weights."""
    slow = json.dumps({"slow_iteration": 6})
    env = _gpt2_env(cluster, data, tmp_path, FAULTS=slow, PYTHONPATH=INJECT + os.pathsep + ROOT, REQUEUE="0")
    log_path = str(tmp_path / "job.out")
    job = sbatch(_without_signal(script, tmp_path), env, log_path, "--time=1", *options)
    fields = wait_for_state(job, env, DONE, timeout=400, log=log_path)
    log = read(log_path)
    stopped = re.search(rf"^exiting at iteration (\d+) of {ITERS}: received SIGTERM ", log, re.M)
    assert fields["JobState"] == "TIMEOUT" and stopped, f"{fields['JobState']}\n{log[-4000:]}"
    iteration = int(stopped.group(1))
    ours = [line for line in log.splitlines() if line.startswith("error: ")]  # SLURM's own say "...: error: ***"
    assert 0 < iteration < ITERS and "Traceback" not in log and not ours, log[-4000:]
    assert open(tmp_path / "checkpoints" / "latest").read().strip() == f"iter_{iteration:07d}"

    env = _gpt2_env(cluster, data, tmp_path, REQUEUE="0")
    job = sbatch(script, env, str(tmp_path / "resumed.out"), *options)
    resumed = _assert_completed(job, env, str(tmp_path / "resumed.out"))
    assert re.search(rf"^loaded checkpoint \S+iter_{iteration:07d}: iteration {iteration},", resumed, re.M)
    reference_log, reference_save = uninterrupted
    assert {**logged_losses(log), **logged_losses(resumed)} == logged_losses(reference_log)
    assert_same_weights(str(tmp_path / "checkpoints"), reference_save)
