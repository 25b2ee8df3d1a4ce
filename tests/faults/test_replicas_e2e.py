"""A bit flipped in one data-parallel replica (silent corruption), through examples/ds_pretrain_gpt2.sh with the
fault plan's flip_bit (harness/faults/plan.py), right after an optimizer step, at the faults layout (1, 2, 2) with
ZeRO stage 0 (under ZeRO-1 the all-gather after the next step copies the owner's partition over a flipped replica,
docs/long-runs.md):

- the uninterrupted run with --check-replicas-interval 3 and --check-replicas-at-save passes every check;
- --check-replicas-interval 3, a parameter flipped on rank 1 after the step of iteration 7: the check of iteration 9
  stops every rank with one line naming the tensor, both replicas of that stage (two cannot outvote each other) and
  the iteration, exit 2; it names iteration 4's checkpoint (the newest saved up to the last passing check, at 6;
  iteration 8's holds the flipped bit), and --ckpt-step 4 resumes on the uninterrupted run's losses, bit for bit;
- --check-replicas-at-save, Adam's exp_avg flipped on rank 1 after the step of iteration 8: the save of iteration 8
  checks first and stops, naming the optimizer state; nothing of iteration 8 was written and `latest` still names
  iteration 4, the checkpoint the line names.
"""
from __future__ import annotations

import os

import pytest

from megatron.checkpointing import read_latest
from harness.faults.script import ITERS, run_script, script_env, zero0_ds_config

pytestmark = pytest.mark.long
ZERO0 = ["--zero-stage", "0"]  # after the script's --zero-stage 1; the JSON's stage must agree (zero0)


@pytest.fixture
def zero0(data, tmp_path):
    """script_env for ZeRO stage 0: the example's DeepSpeed config with stage 0 (DS_CONFIG, as a user edits it)."""
    path = zero0_ds_config(tmp_path)
    return lambda work, **kw: script_env(data, str(tmp_path / work), DS_CONFIG=path, **kw)


def _one_error(run) -> str:
    errors = [line for line in run.log.splitlines() if line.startswith("error: ")]
    assert run.rc == 2 and len(errors) == 1 and "Traceback" not in run.log, run.log[-4000:]
    return errors[0]


def _flipped(run, rank: int, what: str) -> str:
    marker = f"fault: rank {rank} flipped a bit of {what}"
    assert marker in run.log, run.log[-3000:]
    return what + run.log.split(marker)[1].split(" after the step")[0]


def test_a_flipped_replica_stops_the_run_and_the_named_checkpoint_resumes_exactly(zero0, tmp_path):
    checks = ["--check-replicas-interval", "3", "--check-replicas-at-save"]
    checked = run_script(zero0("uninterrupted"), args=ZERO0 + checks)
    assert checked.rc == 0 and sorted(checked.losses) == list(range(1, ITERS + 1)), checked.log[-4000:]

    work = str(tmp_path / "flipped")
    flip = dict(flip_bit=dict(iteration=7, rank=1, what="parameter"))
    run = run_script(zero0("flipped", faults=flip), args=ZERO0 + ["--check-replicas-interval", "3"])
    line, name = _one_error(run), _flipped(run, 1, "parameter ")
    assert line.startswith(f"error: iteration 9: the data-parallel replicas disagree on {name}: data-parallel ranks "
                           f"0 (global rank 0), 1 (global rank 1) hold other bits than each other "
                           f"(--check-replicas-interval 3: silent corruption"), line
    assert line.endswith(f"the last passing check was at iteration 6; the newest checkpoint saved up to then is "
                         f"{work}/checkpoints/iter_0000004: load it with --ckpt-step 4"), line
    assert read_latest(f"{work}/checkpoints") == "iter_0000008"
    assert [run.losses[i] for i in range(1, 8)] == [checked.losses[i] for i in range(1, 8)]  # the checks change nothing
    again = run_script(zero0("flipped"), args=ZERO0 + ["--ckpt-step", "4", "--check-replicas-interval", "3"])
    assert again.rc == 0, again.log[-4000:]
    assert again.losses == {i: checked.losses[i] for i in range(5, ITERS + 1)}


def test_at_save_a_flipped_optimizer_state_is_never_published(zero0, tmp_path):
    work = str(tmp_path / "work")
    flip = dict(flip_bit=dict(iteration=8, rank=1, what="optimizer"))  # after step 8: its parameters still agree
    run = run_script(zero0("work", faults=flip), args=ZERO0 + ["--check-replicas-at-save"])
    line, name = _one_error(run), _flipped(run, 1, "optimizer state exp_avg of ")
    assert line.startswith(f"error: iteration 8: the data-parallel replicas disagree on {name}: "), line
    assert "(--check-replicas-at-save: silent corruption" in line, line
    assert line.endswith(f"the last passing check was at iteration 4; the newest checkpoint saved up to then is "
                         f"{work}/checkpoints/iter_0000004: load it with --ckpt-step 4"), line
    assert read_latest(f"{work}/checkpoints") == "iter_0000004"
    assert not os.path.exists(f"{work}/checkpoints/iter_0000008")
