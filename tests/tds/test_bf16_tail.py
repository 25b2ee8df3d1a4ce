"""The step tail (tds/pipe/bf16_tail.py, the engine's fp32 clip, finite.py's agreement): flat and foreach
operations, no Python loop over parameters per micro-batch, at most one host read per step, and the same training
as DeepSpeed's own BF16_Optimizer tail.

pp = 2 with tied weights (the tied gradient's all-reduce reads the accumulator: bf16, DeepSpeed's default at ZeRO 0,
or fp32, data_types.grad_accum_dtype at ZeRO 1, which DeepSpeed runs with BF16_Optimizer), gradient clipping far
below the norm (every step clipped), the NaN check on and off. DeepSpeed's tail is the same engine with
`"pipeline": {"flat_bf16_tail": false}`; the two differ only in the order the norm sums its squares, so the losses
and fp32 master weights agree to 1e-6 (observed: equal or a few units of the last place).
"""
from __future__ import annotations

import contextlib
import traceback

import pytest
import torch

from harness.dist import run_distributed
from tests.tds import common, harness
from tests.tds.test_engine_tied import specs

MBS, MICRO_BATCHES, STEPS, CLIP = 2, 4, 3, 0.05
HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")


def batches():
    g = torch.Generator().manual_seed(29)
    return [[(torch.randn(MBS, 6, generator=g).bfloat16(), torch.randn(MBS, 6, generator=g))
             for _ in range(MICRO_BATCHES)] for _ in range(STEPS)]


@contextlib.contextmanager
def counting_host_reads(counts: list):
    """Count the Tensor methods that read a value on the host (each one a synchronisation on a GPU)."""
    saved = {name: getattr(torch.Tensor, name) for name in HOST_READS}

    def wrap(name):
        def read(self, *args, **kwargs):
            caller = traceback.extract_stack(limit=2)[0].filename
            if "torch/optim" not in caller:  # not the base optimizer's step counter (a host tensor: Adam's `step`)
                counts.append((name, caller))
            return saved[name](self, *args, **kwargs)
        return read
    for name in HOST_READS:
        setattr(torch.Tensor, name, wrap(name))
    try:
        yield
    finally:
        for name, method in saved.items():
            setattr(torch.Tensor, name, method)


def tail_rank(flat: bool, check_finite: bool, dtype: str = "bf16", accumulate: str = "bf16") -> dict:
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer

    from tds.pipe.bf16_tail import FlatBF16Optimizer
    extra = {"gradient_clipping": CLIP, "pipeline": {"check_finite": check_finite, "flat_bf16_tail": flat}}
    if dtype == "bf16":
        extra["bf16"] = {"enabled": True}
        extra["data_types"] = {"grad_accum_dtype": accumulate}  # DeepSpeed's default: the model's dtype
    zero = 1 if accumulate == "fp32" else 0  # DeepSpeed runs BF16_Optimizer with an fp32 accumulator at ZeRO-1 only
    engine = harness.build(specs(), ([True], ["float"], [False]), pp=2, gas=MICRO_BATCHES, mbs=MBS, zero=zero,
                           opt="adam", extra_cfg=extra)
    assert isinstance(engine.optimizer, FlatBF16Optimizer) == (flat and dtype == "bf16")
    loops, reads, step_reads = [], [], []
    original_update = BF16_Optimizer._update_hp_grad
    BF16_Optimizer._update_hp_grad = lambda *a, **k: (loops.append(1), original_update(*a, **k))[1]
    original_step = engine._step_optimizer

    def counted_step():
        with counting_host_reads(step_reads):
            original_step()
        reads.append(list(step_reads))
        step_reads.clear()
    engine._step_optimizer = counted_step  # noqa: this test's own instrumentation
    losses, norms = [], []
    for step in batches():
        losses.append(engine.train_batch(iter([(x.float() if dtype == "fp32" else x, y) for x, y in step])).item())
        norms.append(float(engine.get_global_grad_norm()))
    BF16_Optimizer._update_hp_grad = original_update
    masters = [p.detach().clone() for p in getattr(engine.optimizer, "fp32_groups_flat_partition", [])]
    return dict(losses=losses, norms=norms, per_parameter_calls=len(loops), host_reads=reads, masters=masters,
                params=harness.engine_params(engine))


LONG = pytest.mark.long


@pytest.mark.parametrize("check_finite,accumulate", [(True, "bf16"), pytest.param(False, "bf16", marks=LONG),
                                                     pytest.param(True, "fp32", marks=LONG)])
def test_flat_bf16_tail_trains_as_deepspeeds(check_finite, accumulate):
    flat = run_distributed(tail_rank, 2, True, check_finite, "bf16", accumulate, timeout=180)
    ds = run_distributed(tail_rank, 2, False, check_finite, "bf16", accumulate, timeout=180)
    for mine, theirs in zip(flat, ds):
        assert len(mine["losses"]) == len(theirs["losses"]) == STEPS and min(mine["norms"]) > 10 * CLIP
        assert mine["per_parameter_calls"] == 0 and theirs["per_parameter_calls"] > 0
        # one host read per step (the NaN check's agreement, which reads the norm with it; or the norm alone)
        assert [len(r) for r in mine["host_reads"]] == [1] * STEPS, mine["host_reads"]
        assert len(theirs["host_reads"][0]) > 1
        for got, want in zip(mine["losses"] + mine["norms"], theirs["losses"] + theirs["norms"]):
            assert abs(got - want) <= 1e-6 * abs(want), (mine["losses"], theirs["losses"], mine["norms"])
        assert len(mine["masters"]) == len(theirs["masters"]) > 0
        for a, b in zip(mine["masters"], theirs["masters"]):
            assert common.max_rel_err(a, b) < 1e-6


@LONG
def test_fp32_clip_reads_nothing_on_the_host_but_the_agreement():
    for r in run_distributed(tail_rank, 2, True, True, "fp32", timeout=180):
        assert [len(x) for x in r["host_reads"]] == [1] * STEPS and len(r["losses"]) == STEPS, r["host_reads"]
