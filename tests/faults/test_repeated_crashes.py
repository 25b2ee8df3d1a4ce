"""Three crashes in one run: examples/ds_pretrain_gpt2.sh with MAX_RESTARTS=3 (torchrun --max-restarts 3) at
(1, 2, 2), --async-save every 2 iterations; a seeded plan SIGKILLs a random rank three times, once per attempt: when
an iteration starts, while a save copies the state, while the background thread writes it (the three points, in a
random order). The run completes, and every logged loss (each restored iteration is logged again) equals the
uninterrupted run's, bit for bit."""
from __future__ import annotations

import random
import re

import pytest

from harness.faults.script import ITERS, logged_in_order, run_script, script_env

pytestmark = pytest.mark.long


def kill_plan(seed: int) -> list:
    """Three kills, at the three points in a random order; attempt a kills at an iteration after any attempt before
    it can have resumed from."""
    rng = random.Random(seed)
    points = rng.sample(["start", "save", "async"], 3)
    iterations = [rng.choice([3, 4, 5]), rng.choice([7, 8]), rng.choice([11, 12])]
    return [dict(attempt=a, rank=rng.randrange(4), iteration=_at(i, at), at=at)
            for a, (i, at) in enumerate(zip(iterations, points))]


def _at(iteration: int, point: str) -> int:
    """A save happens at even iterations (SAVE_INTERVAL 2): a kill during one needs an even iteration."""
    return iteration + iteration % 2 if point in ("save", "async") else iteration


def test_three_kills_in_one_run_complete_with_the_uninterrupted_losses(data, reference, tmp_path):
    seed = random.randrange(1 << 30)
    plan = kill_plan(seed)
    env = script_env(data, str(tmp_path / "work"), faults=dict(kills=plan), MAX_RESTARTS="3", ASYNC_SAVE="1",
                     SAVE_INTERVAL="2")
    run = run_script(env, timeout=900)
    why = f"seed {seed}, plan {plan}:\n{run.log[-5000:]}"
    assert run.rc == 0, why
    killed = re.findall(r"^fault: rank (\d) killed at (\w+) of iteration (\d+) \(attempt (\d)\)", run.log, re.M)
    assert [(int(r), at, int(i), int(a)) for r, at, i, a in killed] == \
        [(k["rank"], k["at"], k["iteration"], k["attempt"]) for k in plan], why
    # four attempts, each from `latest` (or from scratch while none was published: a kill can precede the first)
    assert len(re.findall(r"^(loaded checkpoint |no checkpoint under --load )", run.log, re.M)) == 4, why
    order = logged_in_order(run.log)
    assert order[-1] == ITERS and len(order) > ITERS, why  # restored iterations were trained and logged again
    assert run.losses == reference, why  # every logged loss, repeats included (recorded_losses checks those)
