"""fp16 and bf16: GPT2ModelPipe (GPT-2's layer and the Llama-style layer: rope, RMSNorm, SwiGLU, grouped-query
attention, no biases, untied head) and T5ModelPipe train 5 SGD steps on one repeated batch (ZeRO-1) in fp32, bf16
and fp16, in every layout of the acceptance set, and per step

- the bf16 and fp16 losses follow the fp32 losses of the same layout within TOL[dtype] (relative);
- every layout's losses equal the single process's (the engine at (1, 1, 1) on the same global batch) in
  the same precision within TOL[dtype] (fp32: 1e-5);
- the losses are finite, fall at every step, and all ranks report the same ones.

Tolerance from the dtype's precision. A half-precision run rounds weights, activations and gradients to a
relative error of the unit roundoff u = 2^-p (p significand bits: bf16 p = 8, u = 3.9e-3; fp16 p = 11,
u = 4.9e-4); softmax (inside SDPA), norms and the loss are computed in fp32 from those, and the optimizer
keeps fp32 master weights, so the loss stays within a few u of the fp32 loss: we allow TOL = 4u (bf16
1.6e-2, fp16 2.0e-3; the largest seen is 1.03u, T5 in bf16). A layout changes only the order of the
half-precision sums, so it stays within the same bound of the single process (largest seen: 0.29u). A
broken loss scale or a skipped update would miss by far more: over the 5 steps the fp32 loss falls by 5%
(GPT-2) and 33% (T5).

fp16 runs through DeepSpeed's dynamic loss scaler and fp16 ZeRO-1 optimizer on every CPU: the rank functions
run under `tests.cpu_fp16.allow_cpu_fp16` (DeepSpeed's CPU accelerator otherwise refuses fp16 where oneDNN
lacks fp16 kernels, e.g. on AMD EPYC; torch computes it on any x86 CPU). ZeRO-1 is used for both: with ZeRO-0
and a client (torch) optimizer, DeepSpeed 0.19.8 wraps it in FP16_UnfusedOptimizer, whose gradients come
out divided by the loss scale once too often (engine.backward scales the loss only for ZeRO optimizers).
The default run covers (1, 1, 1) and (2, 2, 2); `-m slow` adds (1, 4, 1) and sequence parallelism at (2, 2, 2)
((2, 1, 1), (1, 2, 1) and sequence parallelism at (4, 1, 1) left the slow suite for CI's time).
"""
from __future__ import annotations

import math

import pytest

from tests.cpu_fp16 import allow_cpu_fp16
from harness.dist import run_distributed
from tests.model import common

STEPS = 5
# name -> (model kind, config): the Llama-style layer without dropout (the file's runs are all dropout-free)
MODELS = {"gpt2": ("gpt2", {}), "llama": ("gpt2", dict(position_embedding_type="rope", normalization="RMSNorm",
                                                         swiglu=True, num_query_groups=2, add_bias_linear=False,
                                                         tie_word_embeddings=False)),
          "t5": ("t5", {})}
KINDS = tuple(MODELS)
PRECISIONS = ("fp32", "bf16", "fp16")
UNIT_ROUNDOFF = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11}
TOL = {"fp32": 1e-5, **{p: 4 * u for p, u in UNIT_ROUNDOFF.items()}}


def run_jobs_any_cpu(jobs: list) -> list:
    with allow_cpu_fp16():
        return common.run_jobs([{k: v for k, v in job.items() if k != "name"} for job in jobs])


def kinds_at(tp: int) -> tuple:
    """The models a tensor-parallel size can split: the Llama-style layer's 2 query groups need tp | 2."""
    return tuple(name for name in KINDS if MODELS[name][1].get("num_query_groups", tp) % tp == 0)


def _jobs(tp: int, pp: int, dp: int, gas: int = common.GAS, sequence_parallel: bool = False) -> list:
    return [dict(kind=MODELS[name][0], tp=tp, pp=pp, dp=dp, config_kw=MODELS[name][1], steps=STEPS, precision=p,
                 zero=1, repeat_batch=True, gas=gas, sequence_parallel=sequence_parallel, name=name)
            for name in kinds_at(tp) for p in PRECISIONS]


def _losses(jobs: list, per_rank: list) -> dict:
    """(kind, precision) -> losses; checks every rank reports the same, finite and falling."""
    out = {}
    for j, job in enumerate(jobs):
        losses = per_rank[0][j]["losses"]
        where = f"{job['name']} {job['precision']} (tp, pp, dp) = {(job['tp'], job['pp'], job['dp'])}: {losses}"
        assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), where
        assert all(b < a for a, b in zip(losses, losses[1:])), f"{where}: not falling"
        assert all(r[j]["losses"] == losses for r in per_rank), f"{where}: ranks disagree"
        out[job["name"], job["precision"]] = losses
    return out


def _assert_close(got: list, want: list, tol: float, where: str) -> None:
    assert len(got) == len(want) == STEPS, where
    errors = [abs(g - w) / abs(w) for g, w in zip(got, want)]
    assert max(errors) <= tol, f"{where}: relative errors {[f'{e:.1e}' for e in errors]} > {tol:.1e}: {got} vs {want}"


@pytest.fixture(scope="module")
def single() -> dict:
    """The engine in one process, every kind and precision, at gas 2 and 4 (the global batches of dp 1, 2):
    {gas: {(kind, precision): losses}}."""
    jobs = _jobs(1, 1, 1) + _jobs(1, 1, 1, gas=2 * common.GAS)
    per_rank = run_distributed(run_jobs_any_cpu, 1, jobs, timeout=500)
    n = len(jobs) // 2
    return {common.GAS: _losses(jobs[:n], [r[:n] for r in per_rank]),
            2 * common.GAS: _losses(jobs[n:], [r[n:] for r in per_rank])}


def check_layout(losses: dict, reference: dict, layout: tuple) -> None:
    for kind in kinds_at(layout[0]):
        for p in PRECISIONS:
            where = f"{kind} {p} {layout}"
            if p != "fp32":
                _assert_close(losses[kind, p], losses[kind, "fp32"], TOL[p], f"{where} vs fp32")
            _assert_close(losses[kind, p], reference[kind, p], TOL[p], f"{where} vs the single process")


def _check(tp: int, pp: int, dp: int, single: dict, sequence_parallel: bool = False) -> None:
    reference = single[common.GAS * dp]
    if (tp, pp, dp) == (1, 1, 1):
        losses = reference
    else:
        jobs = _jobs(tp, pp, dp, sequence_parallel=sequence_parallel)
        losses = _losses(jobs, run_distributed(run_jobs_any_cpu, tp * pp * dp, jobs, timeout=500))
    check_layout(losses, reference, (tp, pp, dp))


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 2, 2)])
def test_half_precision_tracks_fp32_and_single_process(tp, pp, dp, single):
    _check(tp, pp, dp, single)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp", [(1, 4, 1)])
def test_half_precision_tracks_fp32_and_single_process_more_layouts(tp, pp, dp, single):
    _check(tp, pp, dp, single)


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,dp", [(2, 2, 2)])
def test_half_precision_with_sequence_parallel(tp, pp, dp, single):
    """--sequence-parallel in bf16 and fp16 stays within the same tolerances of fp32 and the single process."""
    _check(tp, pp, dp, single, sequence_parallel=True)
