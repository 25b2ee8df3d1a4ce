"""Five crashes in one run: examples/ds_pretrain_gpt2.sh with MAX_RESTARTS=5 (torchrun --max-restarts 5) at
(1, 2, 2), --async-save every 2 iterations; a seeded plan SIGKILLs a random rank at a random point five times, once
per attempt: when an iteration starts, while a save copies the state, while the background thread writes it. The
run completes, and every logged loss (each restored iteration is logged again) equals the uninterrupted run's,
bit for bit."""
from __future__ import annotations

import random
import re

import pytest

from harness.faults.script import ITERS, logged_in_order, run_script, script_env

pytestmark = pytest.mark.long


def kill_plan(seed: int) -> list:
    """Five kills, attempt a killing at an iteration after any attempt before it can have resumed from."""
    rng = random.Random(seed)
    rank = lambda: rng.randrange(4)  # noqa: E731
    return [dict(attempt=0, rank=rank(), iteration=rng.choice([3, 4, 5]), at="start"),
            dict(attempt=1, rank=rank(), iteration=6, at="save"),
            dict(attempt=2, rank=rank(), iteration=8, at="async"),
            dict(attempt=3, rank=rank(), iteration=rng.choice([10, 11]), at="start"),
            dict(attempt=4, rank=rank(), iteration=rng.choice([12, 14]), at=rng.choice(["save", "async"]))]


def test_five_kills_in_one_run_complete_with_the_uninterrupted_losses(data, reference, tmp_path):
    seed = random.randrange(1 << 30)
    plan = kill_plan(seed)
    env = script_env(data, str(tmp_path / "work"), faults=dict(kills=plan), MAX_RESTARTS="5", ASYNC_SAVE="1",
                     SAVE_INTERVAL="2")
    run = run_script(env, timeout=900)
    why = f"seed {seed}, plan {plan}:\n{run.log[-5000:]}"
    assert run.rc == 0, why
    killed = re.findall(r"^fault: rank (\d) killed at (\w+) of iteration (\d+) \(attempt (\d)\)", run.log, re.M)
    assert [(int(r), at, int(i), int(a)) for r, at, i, a in killed] == \
        [(k["rank"], k["at"], k["iteration"], k["attempt"]) for k in plan], why
    # six attempts, each from `latest` (or from scratch while none was published: a kill can precede the first)
    assert len(re.findall(r"^(loaded checkpoint |no checkpoint under --load )", run.log, re.M)) == 6, why
    order = logged_in_order(run.log)
    assert order[-1] == ITERS and len(order) > ITERS, why  # restored iterations were trained and logged again
    assert run.losses == reference, why  # every logged loss, repeats included (recorded_losses checks those)
