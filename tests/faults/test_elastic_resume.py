"""Elastic resume through examples/ds_pretrain_gpt2.sh, as a user runs it after losing nodes: a run at
(dp, gas) = (4, 1) (tp = pp = 1, micro-batch 2, global batch 8, ZeRO-1, dropout on) stops at iteration 8 with its
checkpoint (`--exit-interval 8`); the same WORK_DIR is run again at (2, 2) on 2 processes and at (1, 4) on 1, and
each resumes from `latest` (the checkpoint reshaped on load) to iteration 16. Every later loss equals the
uninterrupted run's, continued at (4, 1), within 1e-5 relative: the samples and the dropout masks follow the single
process's micro-batch at every split, and only the gradient sums associate differently (docs/long-runs.md). They do
differ: some loss is not bit-equal (the negative control of --layout-invariant's test).

With --layout-invariant (and the example's ZeRO-1, whose partitions the resumed runs cut again: in two at dp 2, as
stage 0's per-parameter states at dp 1) every later loss is the uninterrupted run's bit for bit."""
from __future__ import annotations

import shutil

import numpy as np
import pytest

from megatron.checkpointing import read_latest
from harness.faults.script import ITERS, run_script, script_env

pytestmark = pytest.mark.long
RTOL = 1e-5
STOP = 8


def _at(data: dict, work, nproc: int, gas: int, **extra) -> dict:
    return script_env(data, str(work), NPROC=str(nproc), GAS=str(gas), TP="1", PP="1", MICRO_BATCH="2", **extra)


@pytest.mark.parametrize("invariant", [False, True], ids=["plain", "layout_invariant"])
def test_a_run_saved_at_dp_4_continues_at_dp_2_and_dp_1(data, tmp_path, invariant):
    flags = ["--layout-invariant"] if invariant else []

    def run(work, nproc: int, gas: int, args=()):
        return run_script(_at(data, work, nproc, gas), args=[*flags, *args])

    first = tmp_path / "dp4"
    stopped = run(first, 4, 1, ["--exit-interval", str(STOP)])
    assert stopped.rc == 0 and sorted(stopped.losses) == list(range(1, STOP + 1)), stopped.log[-4000:]
    assert read_latest(str(first / "checkpoints")) == f"iter_{STOP:07d}"
    for nproc in (2, 1):
        shutil.copytree(first, tmp_path / f"dp{nproc}")
    straight = run(first, 4, 1)
    assert straight.rc == 0 and sorted(straight.losses) == list(range(STOP + 1, ITERS + 1)), straight.log[-4000:]
    later = [straight.losses[i] for i in range(STOP + 1, ITERS + 1)]
    for nproc, gas in ((2, 2), (1, 4)):
        resumed = run(tmp_path / f"dp{nproc}", nproc, gas)
        assert resumed.rc == 0 and sorted(resumed.losses) == list(range(STOP + 1, ITERS + 1)), resumed.log[-4000:]
        losses = [resumed.losses[i] for i in range(STOP + 1, ITERS + 1)]
        where = f"resumed at (dp, gas) = ({nproc}, {gas})"
        if invariant:
            assert [x.hex() for x in losses] == [x.hex() for x in later], f"{where}: not bit for bit"
            continue
        np.testing.assert_allclose(losses, later, rtol=RTOL, err_msg=where)
        assert losses != later, f"{where}: bit for bit without --layout-invariant (the negative control)"
        gap = max(abs(a / b - 1) for a, b in zip(losses, later))
        print(f"(dp, gas) = ({nproc}, {gas}): largest relative difference from (4, 1): {gap:.2e}")
