"""Issue 12: GPT2ModelPipe and T5ModelPipe under the interleaved 1F1B (2 chunks per stage) and ZB-H1 schedules
give the per-step losses, the first-step gradients and the eval loss of the single-process plain model
(fp32, relative error < 1e-5), at pp in {2, 4} x tp in {1, 2} x dp in {1, 2}; ZeRO-1 where dp = 2.

Under ZB-H1 the tensor-parallel linears (megatron/mpu/layers.py) really defer their weight gradients: the
engine attaches its store to every Column/RowParallelLinear (counted) and W work is pending between B and W.
Dropout is on with activation checkpointing in some jobs at tp = dp = 1: the masks are a function of (iteration,
micro-batch, site), and each chunk runs its micro-batches in order, so they equal the plain model's.
The default run is one launch of 4 ranks over a representative subset; `-m slow` runs the full grid.
"""
from __future__ import annotations

import itertools

import pytest

from harness.dist import run_distributed
from tests.model import common

STEPS = 3
TOL = 1e-5
DROPOUT_CKPT = dict(hidden_dropout=0.1, attention_dropout=0.1, checkpoint_num_layers=1)
DEEP = {"gpt2": dict(num_layers=8), "t5": dict(num_layers=4, num_decoder_layers=4)}  # 8 chunks at pp 4 x v 2


def job(kind: str, tp: int, pp: int, dp: int, schedule: str, config_kw: dict | None = None) -> dict:
    """ZeRO-1 with data parallelism (the first-step gradients are then inside DeepSpeed's flat partitions, so
    losses and the eval loss are compared); without, ZeRO 0 and the gradients are compared too."""
    v = 2 if schedule == "interleaved" else 1
    kw = dict(DEEP[kind] if pp * v > 4 else {}, **(config_kw or {}))
    return dict(kind=kind, tp=tp, pp=pp, dp=dp, config_kw=kw, steps=STEPS, gas=4, schedule=schedule,
                virtual_stages=v, zero=1 if dp > 1 else 0)


def schedule_rank(jobs: list) -> list:
    """common.pipe_rank per job, plus how many linears ZB-H1 attached its store to (counted on a fresh build)."""
    out = []
    for j in jobs:
        r = common.pipe_rank(**j)
        r["attached"] = _attached_linears(j) if j["schedule"] == "zb-h1" else None
        out.append(r)
    return out


def _attached_linears(j: dict) -> tuple[int, int]:
    """(modules attach() gives a store, Column/RowParallelLinear layers and LM heads: the word table or the
    untied output layer) of a stage built like the job's."""
    from megatron import mpu
    from megatron.model.gpt2_model import GPT2Embedding
    from megatron.model.gpt2_pipe import GPT2ModelPipe
    from megatron.model.language_model import OutputLayer
    from megatron.model.t5_model import T5Embedding
    from megatron.model.t5_pipe import T5ModelPipe
    from tds.pipe.weight_grad import WeightGradStore, attach
    mpu.initialize_model_parallel(j["tp"], j["pp"])
    try:
        model = (GPT2ModelPipe if j["kind"] == "gpt2" else T5ModelPipe)(common.make_config(j["kind"], **j["config_kw"]))
        gemms = (mpu.ColumnParallelLinear, mpu.RowParallelLinear, OutputLayer, GPT2Embedding, T5Embedding)
        linears = [m for m in model.modules() if isinstance(m, gemms)]
        return attach(model, WeightGradStore()), len(linears)
    finally:
        mpu.destroy_model_parallel()


def check(jobs: list, per_rank: list) -> None:
    refs = {}
    for k, j in enumerate(jobs):
        key = (j["kind"], tuple(sorted(j["config_kw"].items())), j["dp"])
        if key not in refs:
            config = common.make_config(j["kind"], **j["config_kw"])
            batches = common.make_batches(j["kind"], config, STEPS, common.MBS * j["gas"] * j["dp"])
            refs[key] = common.reference_run(j["kind"], config, batches)
        ref, results = refs[key], [r[k] for r in per_rank]
        where = f"{j['kind']} {j['schedule']} (tp, pp, dp) = {(j['tp'], j['pp'], j['dp'])} {j['config_kw']}"
        for r in results:
            assert len(r["losses"]) == STEPS, where
            for step, (got, want) in enumerate(zip(r["losses"], ref["losses"])):
                assert abs(got - want) <= TOL * abs(want), f"{where}: step {step} loss {got} vs plain {want}"
            assert abs(r["eval_loss"] - ref["eval_loss"]) <= TOL * abs(ref["eval_loss"]), where
            if j["schedule"] == "zb-h1":
                attached, linears = r["attached"]
                assert attached == linears > 0, f"{where}: attach() reached {attached} of {linears} tp linears"
        if j["zero"] == 0:
            assert common.check_grads(results, ref["grads"], j["tp"], TOL) == len(ref["grads"]), where


# dropout only at tp = dp = 1: by design (megatron/model/rng.py) attention-probability masks depend on the tp
# rank, and data-parallel replicas draw the masks of their own m-th micro-batch
DEFAULT = [job("gpt2", 2, 2, 1, "interleaved"), job("t5", 1, 2, 2, "zb-h1"),
           job("t5", 1, 4, 1, "interleaved", DROPOUT_CKPT), job("gpt2", 1, 4, 1, "zb-h1", DROPOUT_CKPT)]


@pytest.mark.long
def test_gpt2_and_t5_schedules_match_plain_model():
    check(DEFAULT, run_distributed(schedule_rank, 4, DEFAULT, timeout=600))


def grid(world: int) -> list:
    return [job(kind, tp, pp, dp, schedule)
            for pp, tp, dp in itertools.product([2, 4], [1, 2], [1, 2]) if pp * tp * dp == world
            for kind in ("gpt2", "t5") for schedule in ("interleaved", "zb-h1")]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4, 8])  # up to 8 processes on 2 cores
def test_full_grid(world):
    jobs = grid(world)
    check(jobs, run_distributed(schedule_rank, world, jobs, timeout=1800))
