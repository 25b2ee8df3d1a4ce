"""A bit flipped in one data-parallel replica (silent corruption), through examples/ds_pretrain_gpt2.sh with the
fault plan's flip_bit (harness/faults/plan.py), right after an optimizer step:

- --check-replicas-interval 3 at the faults layout (1, 2, 2) with ZeRO-1, a parameter flipped on rank 1 after the
  step of iteration 7: the check of iteration 9 stops every rank with one line naming the tensor, both replicas of
  that stage (two cannot outvote each other) and the iteration, exit 2; it names iteration 4's checkpoint (saved
  before the last passing check, at 6; iteration 8's holds the flipped bit), and --ckpt-step 4 resumes on the
  uninterrupted run's losses, bit for bit;
- --check-replicas-at-save at (1, 1, 4) with ZeRO stage 0, Adam's exp_avg flipped on rank 2 after the step of
  iteration 8: the save of iteration 8 checks first and stops, naming the optimizer state and rank 2 alone;
  nothing of iteration 8 was written and `latest` still names iteration 4.
"""
from __future__ import annotations

import json
import os

import pytest

from megatron.checkpointing import read_latest
from harness.faults.script import ITERS, run_script, script_env

pytestmark = pytest.mark.long


def _one_error(run) -> str:
    errors = [line for line in run.log.splitlines() if line.startswith("error: ")]
    assert run.rc == 2 and len(errors) == 1 and "Traceback" not in run.log, run.log[-4000:]
    return errors[0]


def test_a_flipped_parameter_stops_the_run_and_the_named_checkpoint_resumes_exactly(data, reference, tmp_path):
    work = str(tmp_path / "work")
    flip = dict(flip_bit=dict(iteration=7, rank=1, what="parameter"))
    run = run_script(script_env(data, work, faults=flip), args=["--check-replicas-interval", "3"])
    line = _one_error(run)
    assert "fault: rank 1 flipped a bit of parameter " in run.log, run.log[-3000:]
    name = run.log.split("fault: rank 1 flipped a bit of ")[1].split(" after the step")[0]
    assert line.startswith(f"error: iteration 9: the data-parallel replicas disagree on {name}: data-parallel ranks "
                           f"0 (global rank "), line
    assert "(--check-replicas-interval 3: silent corruption" in line, line
    assert line.endswith(f"the newest checkpoint saved before the last passing check (iteration 6) is "
                         f"{work}/checkpoints/iter_0000004: load it with --ckpt-step 4"), line
    assert read_latest(f"{work}/checkpoints") == "iter_0000008"
    again = run_script(script_env(data, work), args=["--ckpt-step", "4", "--check-replicas-interval", "3"])
    assert again.rc == 0, again.log[-4000:]
    assert again.losses == {i: reference[i] for i in range(5, ITERS + 1)}


def test_at_save_a_flipped_optimizer_state_is_never_published(data, tmp_path):
    work, ds_config = str(tmp_path / "work"), str(tmp_path / "ds_zero0.json")
    with open(os.path.join(os.path.dirname(__file__), "..", "..", "examples", "ds_config_gpt2.json")) as f:
        cfg = json.load(f)
    cfg["zero_optimization"]["stage"] = 0
    with open(ds_config, "w") as f:
        json.dump(cfg, f)
    flip = dict(flip_bit=dict(iteration=8, rank=2, what="optimizer"))  # after step 8: its parameters still agree
    run = run_script(script_env(data, work, faults=flip, PP="1", DS_CONFIG=ds_config),
                     args=["--zero-stage", "0", "--check-replicas-at-save"])
    line = _one_error(run)
    assert "fault: rank 2 flipped a bit of optimizer state exp_avg of " in run.log, run.log[-3000:]
    assert line.startswith("error: iteration 8: the data-parallel replicas disagree on optimizer state exp_avg of "), \
        line
    assert "data-parallel rank 2 (global rank 2) holds other bits than the rest (--check-replicas-at-save" in line, line
    assert line.endswith(f"{work}/checkpoints/iter_0000004: load it with --ckpt-step 4"), line
    assert read_latest(f"{work}/checkpoints") == "iter_0000004"
    assert not os.path.exists(f"{work}/checkpoints/iter_0000008")
