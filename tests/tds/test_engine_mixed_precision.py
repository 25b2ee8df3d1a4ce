"""bf16 and fp16 pipelines with tied weights, at (pp, dp) = (2, 1) with ZeRO stage 0 and (2, 2) with stage 1, against
one process running the same engine in the same precision on the same global batch.

The tied module (embedding on the first stage, head on the last) leaves its bias unused on the last stage: with
BF16_Optimizer (bf16 at ZeRO 0) that bias has no `_hp_grad` there, which used to raise on that stage while its
peer waited forever in the tied all-reduce. fp16 at ZeRO 0 runs DeepSpeed's FP16_UnfusedOptimizer, whose loss
scale DeepSpeed 0.19's engine.backward never applies (the engine applies it).

Tolerance: the layouts differ from the single process only in the order of low-precision additions (the
tied gradient is summed over stages instead of inside one autograd graph, data-parallel replicas average in
the reduction). Each such rounding is at most one unit in the last place, eps = 2^-8 (bf16) or 2^-11 (fp16),
relative; over 3 Adam steps and 4 micro-batches we allow 4 eps on losses and on every parameter (observed:
at most 0.75 eps).

fp16 on a CPU: DeepSpeed refuses fp16 where oneDNN has no fp16 kernels (some AMD CPUs), although torch
computes fp16 on every x86 CPU; `tests.cpu_fp16.allow_cpu_fp16` makes DeepSpeed's capability check say yes
inside the ranks, so this runs on every machine.
"""
from __future__ import annotations

import pytest
import torch

from tests.cpu_fp16 import allow_cpu_fp16
from harness.dist import run_distributed
from tests.tds import common, harness
from tests.tds.test_engine_tied import specs

MBS, MICRO_BATCHES, STEPS = 2, 4, 3
EPS = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16}


def batches(dtype: str):
    g = torch.Generator().manual_seed(19)
    return [[(torch.randn(MBS, 6, generator=g).to(DTYPE[dtype]), torch.randn(MBS, 6, generator=g))
             for _ in range(MICRO_BATCHES)] for _ in range(STEPS)]


def precision_rank(dtype: str, pp: int, dp: int, zero: int, opt: str = "adam") -> dict:
    with allow_cpu_fp16():
        return _train(dtype, pp, dp, zero, opt)


def _train(dtype: str, pp: int, dp: int, zero: int, opt: str) -> dict:
    extra = {dtype: {"enabled": True}}
    if dtype == "fp16":
        extra["fp16"].update(initial_scale_power=8, loss_scale_window=1000)
    gas = MICRO_BATCHES // dp
    engine = harness.build(specs(), ([True], ["float"], [False]), pp=pp, dp=dp, gas=gas, mbs=MBS, zero=zero,
                           opt=opt, extra_cfg=extra)
    dp_rank = engine.grid.get_data_parallel_rank()
    mine = [step[dp_rank * gas:(dp_rank + 1) * gas] for step in batches(dtype)]
    losses = harness.train(engine, mine)
    return {"losses": losses, "params": harness.engine_params(engine), "optimizer": type(engine.optimizer).__name__,
            "depth": getattr(engine.optimizer, "_backward_active_depth", 0)}


CASES = [pytest.param("bf16", 2, 1, 0, id="bf16-pp2-dp1-zero0"),
         pytest.param("bf16", 2, 2, 1, id="bf16-pp2-dp2-zero1", marks=pytest.mark.long),
         pytest.param("fp16", 2, 1, 0, id="fp16-pp2-dp1-zero0"),
         pytest.param("fp16", 2, 2, 1, id="fp16-pp2-dp2-zero1", marks=pytest.mark.long)]



@pytest.mark.parametrize("dtype,pp,dp,zero", CASES)
def test_tied_weights_in_half_precision_match_single_process(dtype, pp, dp, zero):
    results = run_distributed(precision_rank, pp * dp, dtype, pp, dp, zero, timeout=180)
    ref = run_distributed(precision_rank, 1, dtype, 1, 1, zero, timeout=120)[0]
    tol = 4 * EPS[dtype]
    for r in results:
        assert len(r["losses"]) == len(ref["losses"]) == STEPS
        for step, (got, want) in enumerate(zip(r["losses"], ref["losses"])):
            assert abs(got - want) <= tol * abs(want), f"{dtype} step {step}: loss {got} vs {want} ({r['optimizer']})"
        for name, p in r["params"].items():
            err = common.max_rel_err(p, ref["params"][name])
            assert err <= tol, f"{dtype} {name}: rel err {err:.2e} > {tol:.1e} ({r['optimizer']})"
        assert r["depth"] == 0
    stage_of = {0: results[0], 1: results[dp]}  # ranks 0 and dp are data-parallel rank 0 of stages 0 and 1
    for name in (n for n in stage_of[0]["params"] if n.startswith("tied.")):
        assert torch.equal(stage_of[0]["params"][name], stage_of[1]["params"][name]), f"tied {name} differs"


def test_fp16_at_zero0_applies_the_loss_scale():
    """FP16_UnfusedOptimizer (ZeRO 0) divides gradients by the loss scale in step(); DeepSpeed 0.19's
    engine.backward only multiplies by it for ZeRO optimizers. With SGD (which, unlike Adam, is not invariant
    to a gradient's scale) ZeRO 0 must then train exactly like ZeRO 1, whose optimizer scales and unscales."""
    zero0 = run_distributed(precision_rank, 2, "fp16", 2, 1, 0, "sgd", timeout=120)
    zero1 = run_distributed(precision_rank, 2, "fp16", 2, 1, 1, "sgd", timeout=120)
    assert zero0[0]["optimizer"] == "FP16_UnfusedOptimizer" and zero1[0]["optimizer"] == "DeepSpeedZeroOptimizer"
    assert zero0[0]["losses"] == zero1[0]["losses"] and len(zero0[0]["losses"]) == STEPS
    for name, p in zero1[0]["params"].items():
        assert torch.equal(zero0[0]["params"][name], p), name
