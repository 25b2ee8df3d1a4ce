"""Signals through examples/ds_pretrain_gpt2.sh at (tp, pp, dp) = (1, 2, 2), each run resumed and compared with
the uninterrupted run's logged losses, bit for bit:

- the whole job signalled at once (SLURM's time limit and preemption, `scancel`, systemd's stop,
  `kill -- -PGID`): SIGTERM and SIGUSR1 to the script's process group, with torchrun and with DeepSpeed's
  launcher: a checkpoint at the current iteration, exit 0;
- one rank signalled (one node preempted): every rank agrees, saves at the same iteration and exits 0;
- SIGTERM during an asynchronous save, and twice during an evaluation: one checkpoint at the right iteration;
- a gradient made NaN on one pipeline stage: every rank stops before that iteration's step, one line, exit 2.
"""
from __future__ import annotations

import os
import random
import re
import signal

import pytest

from megatron.checkpointing import read_latest
from harness.faults.script import (ITERS, reports, run_script, script_env, stopped_at, to_group, to_rank)

pytestmark = pytest.mark.long


def _resume_matches(data, work, reference, stop: int) -> None:
    """The script run again resumes after `stop` and logs the uninterrupted run's losses."""
    again = run_script(script_env(data, work))
    assert again.rc == 0, again.log[-4000:]
    assert f"loaded checkpoint {work}/checkpoints/iter_{stop:07d}: iteration {stop}," in again.log, again.log[-3000:]
    assert sorted(again.losses) == list(range(stop + 1, ITERS + 1)), again.log[-3000:]
    assert again.losses == {i: reference[i] for i in range(stop + 1, ITERS + 1)}


@pytest.mark.parametrize("sig,launcher", [(signal.SIGTERM, "deepspeed"), (signal.SIGUSR1, "torchrun")],
                         ids=["SIGTERM-deepspeed", "SIGUSR1-torchrun"])  # each signal and each launcher once
def test_signal_to_the_whole_job_saves_exits_0_and_resumes_exactly(data, reference, tmp_path, launcher, sig):
    work, at = str(tmp_path / "work"), random.randint(3, 9)
    run = run_script(script_env(data, work, LAUNCHER=launcher), when={rf"^ *iteration {at}/{ITERS} \|": to_group(sig)})
    name = signal.Signals(sig).name
    assert run.rc == 0, run.log[-4000:]
    stop = stopped_at(run.log, name)
    assert at <= stop <= at + 2 and read_latest(f"{work}/checkpoints") == f"iter_{stop:07d}", (at, run.log[-3000:])
    assert f"received {name}: passing it to the training processes (4)" in run.log, run.log[-3000:]
    assert "Traceback" not in run.log, run.log[-4000:]
    assert run.losses == {i: reference[i] for i in range(1, stop + 1)}
    _resume_matches(data, work, reference, stop)


def test_signal_to_one_rank_stops_every_rank_at_the_same_iteration(data, reference, tmp_path):
    work, report = str(tmp_path / "work"), tmp_path / "report"
    report.mkdir()
    at, rank = random.randint(3, 9), random.randrange(4)
    run = run_script(script_env(data, work, faults=dict(report=str(report))),
                     when={rf"^ *iteration {at}/{ITERS} \|": to_rank(signal.SIGTERM, rank)})
    assert run.rc == 0, run.log[-4000:]
    stop = stopped_at(run.log, "SIGTERM")
    assert at <= stop <= at + 2, (at, rank, run.log[-3000:])
    ends = reports(str(report))
    assert [(r["rank"], r["iteration"], r["outcome"]) for r in ends] == [(r, stop, "returned") for r in range(4)], ends
    assert read_latest(f"{work}/checkpoints") == f"iter_{stop:07d}"
    _resume_matches(data, work, reference, stop)


def test_sigterm_during_an_asynchronous_save(data, reference, tmp_path):
    """The save of iteration 4 is still being written when the whole job gets SIGTERM: it is completed and
    published, then the run saves again where it stops; `latest` names that one."""
    work = str(tmp_path / "work")
    run = run_script(script_env(data, work, faults=dict(slow_async=0.5), ASYNC_SAVE="1"),
                     when={r"^fault: async write of iter_0000004 started": to_group(signal.SIGTERM)})
    assert run.rc == 0, run.log[-4000:]
    stop = stopped_at(run.log, "SIGTERM")
    assert 5 <= stop <= 7 and read_latest(f"{work}/checkpoints") == f"iter_{stop:07d}", run.log[-3000:]
    assert re.search(r"saved checkpoint \S+iter_0000004 \(written in the background\)", run.log), run.log[-3000:]
    _resume_matches(data, work, reference, stop)


def test_sigterm_twice_during_an_evaluation(data, reference, tmp_path):
    """Two SIGTERMs to the job while the evaluation after iteration 8 runs: the agreement read after iteration 8
    was posted before the signal, so every rank runs iteration 9, saves there and exits 0. And a third copy
    reaches every rank late, after its handlers are restored (the script's or the launcher's forward on a loaded
    machine), and ends it: the clean end was recorded before, so the script still exits 0."""
    work = str(tmp_path / "work")

    def twice(proc):
        os.killpg(proc.pid, signal.SIGTERM)
        os.killpg(proc.pid, signal.SIGTERM)
    run = run_script(script_env(data, work, faults=dict(slow_eval=1.0, late_signal=True)),
                     when={r"^fault: evaluation after iteration 8 started": twice})
    assert run.rc == 0, run.log[-4000:]
    assert "fault: rank 0 gets a late SIGTERM" in run.log, run.log[-4000:]
    assert stopped_at(run.log, "SIGTERM") == 9 and read_latest(f"{work}/checkpoints") == "iter_0000009"
    assert "valid loss at iteration 8" in run.log
    _resume_matches(data, work, reference, 9)


def test_gradient_nan_on_one_stage_stops_every_rank_before_the_step(data, tmp_path):
    work, report = str(tmp_path / "work"), tmp_path / "report"
    report.mkdir()
    stage, at = random.randrange(2), random.randint(5, 7)
    run = run_script(script_env(data, work, faults=dict(grad_nan=dict(stage=stage, iteration=at), report=str(report))))
    assert run.rc == 2, run.log[-4000:]
    errors = [line for line in run.log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and "Traceback" not in run.log, run.log[-4000:]
    assert errors[0].startswith(f"error: iteration {at}: ") and "the optimizer step was not taken" in errors[0]
    assert f"gradients on stages [{stage}]" in errors[0] and "forward on stages" not in errors[0], errors[0]
    assert f"{work}/checkpoints/iter_0000004 (iteration 4)" in errors[0], errors[0]
    ends = reports(str(report))
    assert [(r["rank"], r["iteration"], r["steps"]) for r in ends] == [(r, at - 1, at - 1) for r in range(4)], ends
    assert all(r["outcome"].startswith("TrainingStopped") for r in ends), ends
    assert read_latest(f"{work}/checkpoints") == "iter_0000004"
