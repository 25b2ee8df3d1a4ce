"""Sample-based training through pretrain_gpt2.py (real GPT-2, dropout on): --train-samples,
--rampup-batch-size, --lr-warmup-samples, --lr-decay-samples, --lr-decay-style inverse-square-root.

Ramp 4 -> 12 by 4 over 24 samples, micro-batch 2, dp 2 (4 samples per global micro-batch), 76 samples:
global batches 4, 4, 4, 8, 8, then 12 x 4 (9 iterations; Megatron's RampupBatchsizeNumMicroBatches).

- (tp, pp, dp) = (1, 2, 2): the consumed samples follow the ramp, the logged LR is Megatron's
  inverse-square-root schedule in samples, and a run stopped mid-ramp (--exit-interval 4, next batch 8) and
  resumed reproduces the uninterrupted run's losses bit for bit.
- The pipeline engine at (1, 2, 2) and DeepSpeed's engine at (2, 1, 2) follow the ramp alike (dropout off, as
  tp = 2 splits the attention-dropout sites): same losses (fp32, relative error < 1e-5). Had an engine run
  another number of micro-batches than the ramp's, the data position would not match the consumed samples
  and the resumed losses would differ.
"""
from __future__ import annotations

import contextlib
import io
import math
import re

import pytest

from megatron.config.batch_schedule import BatchSchedule
from megatron.training.learning_rates import annealed_lr
from harness.dist import run_distributed
from tests.training.runner import small_argv, train_state

RAMP = ["--rampup-batch-size", "4", "4", "24"]
LR, MIN_LR, WARMUP, DECAY = 1e-3, 1e-5, 8, 64
SAMPLES = ["--train-samples", "76", "--global-batch-size", "12", *RAMP, "--lr-decay-style", "inverse-square-root",
           "--lr-warmup-samples", str(WARMUP), "--lr-decay-samples", str(DECAY), "--min-lr", str(MIN_LR),
           "--log-interval", "1", "--eval-interval", "100"]
BATCHES = [4, 4, 4, 8, 8, 12, 12, 12, 12]


def _argv(data: dict, pp: int, extra=()) -> list:
    argv = small_argv(data, pp=pp, extra=[*SAMPLES, *extra])
    i = argv.index("--train-iters")  # small_argv is iteration-based
    del argv[i:i + 2]
    i = argv.index("--lr-warmup-iters")
    del argv[i:i + 2]
    return argv


def _run(argv: list, world_size: int) -> dict:
    """pretrain_gpt2 on this rank; its losses and, from the last rank's log, (consumed samples, lr) per iteration."""
    from pretrain_gpt2 import DEFAULTS, SPEC
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        state = train_state(argv, world_size, SPEC, DEFAULTS)
    log = re.findall(r"iteration (\d+)/\d+ \| consumed samples (\d+) \| lr ([0-9.e+-]+)", out.getvalue())
    return dict(losses=state.losses, consumed=state.consumed_train_samples,
                log=[(int(i), int(c), float(lr)) for i, c, lr in log])


def _runs(data: dict, save: str, world_size: int) -> list:
    """On the same 4 ranks at (1, 2, 2): straight, stopped at iteration 4, resumed; then dropout off with the
    pipeline engine and with DeepSpeed's engine at (2, 1, 2)."""
    straight = _run(_argv(data, 2), world_size)
    io_args = ["--save", save, "--load", save]
    stopped = _run(_argv(data, 2, [*io_args, "--exit-interval", "4"]), world_size)
    resumed = _run(_argv(data, 2, io_args), world_size)
    no_dropout = ["--hidden-dropout", "0", "--attention-dropout", "0"]
    pipe = _run(_argv(data, 2, no_dropout), world_size)
    plain = _run(_argv(data, 1, [*no_dropout, "--tensor-model-parallel-size", "2"]), world_size)
    return [straight, stopped, resumed, pipe, plain]


def test_megatron_ramp_and_iterations():
    schedule = BatchSchedule(12, 2, 2, (4, 4, 24))
    consumed, batches = 0, []
    for _ in range(schedule.train_iters(76)):
        batches.append(schedule.global_batch(consumed))
        consumed += batches[-1]
    assert batches == BATCHES and consumed == 76
    assert [schedule.micro_batches(c) for c in (0, 12, 28)] == [1, 2, 3]
    assert schedule.train_iters(20) == 4 and BatchSchedule(12, 2, 2).train_iters(76) == 6


def test_inverse_square_root_is_megatrons_formula():
    for n in (0, 3, 8, 9, 20, 63, 64, 100):
        if n < WARMUP:
            want = LR * n / WARMUP
        elif n >= DECAY:
            want = MIN_LR
        else:  # Megatron-LM OptimizerParamScheduler, 'inverse-square-root'
            want = max(MIN_LR, LR * max(WARMUP, 1) ** 0.5 / max(n, 1) ** 0.5)
        assert annealed_lr(n, LR, MIN_LR, WARMUP, DECAY, "inverse-square-root") == pytest.approx(want, rel=1e-12)


@pytest.mark.long
def test_ramp_resume_is_bit_exact_and_engines_agree(gpt_data, tmp_path):
    straight, stopped, resumed, pipe, plain = run_distributed(_runs, 4, gpt_data, str(tmp_path / "ckpt"), 4,
                                                              timeout=900)[-1]
    consumed = [sum(BATCHES[:i]) for i in range(1, len(BATCHES) + 1)]
    assert [c for _, c, _ in straight["log"]] == consumed and straight["consumed"] == 76
    for i, (_, _, lr) in enumerate(straight["log"]):  # the LR schedule runs in samples
        want = annealed_lr(consumed[i] - BATCHES[i], LR, MIN_LR, WARMUP, DECAY, "inverse-square-root")
        assert math.isclose(lr, want, rel_tol=1e-4), (i, lr, want)
    assert len(stopped["losses"]) == 4 and stopped["consumed"] == 20
    assert resumed["losses"] == straight["losses"][4:]  # bit for bit, resumed mid-ramp
    assert [c for _, c, _ in plain["log"]] == consumed and len(plain["losses"]) == len(BATCHES)
    for got, want in zip(plain["losses"], pipe["losses"]):
        assert abs(got - want) <= 1e-5 * abs(want), (plain["losses"], pipe["losses"])
