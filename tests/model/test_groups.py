"""The process groups are built once, by `mpu.initialize_model_parallel`, and the pipeline engine uses them.

At (tp, pp, dp) = (2, 2, 2) GPT2ModelPipe is built over the ParallelState and trained one batch by the TDS engine
while `torch.distributed.new_group` counts calls: none happen after start-up, and the engine's groups (grid,
tensor, pipeline, data, model = pipe x tensor, point-to-point, tied embedding) are the state's group objects.
The same model built on the bare topology makes tds build groups of its own (the counter sees them), and both
give the same loss, bit for bit.
"""
from __future__ import annotations

import pytest

from harness.dist import run_distributed
from tests.model import common

TP, PP, DP = 2, 2, 2


def _train_one_batch(model, state, config, mpu):
    import torch
    import tds
    optimizer = torch.optim.SGD(model.parameters(), lr=common.LR)
    engine, _, _, _ = tds.initialize(model=model, optimizer=optimizer, config=common.ds_config(DP), mpu=mpu)
    micro = common.make_batches("gpt2", config, 1, common.MBS * common.GAS * DP)[0]
    loss = engine.train_batch(iter(micro[state.dp_rank * common.GAS:(state.dp_rank + 1) * common.GAS]))
    return engine, loss.item()


def _engine_rank(handed: bool) -> dict:
    """Build and train with the state handed (or the topology only); the groups created meanwhile and which
    of the engine's groups are the state's own objects."""
    import torch.distributed as dist
    import tds
    from megatron import mpu
    from megatron.model.gpt2_pipe import GPT2ModelPipe
    tds.init_distributed(dist_backend="gloo")
    state = mpu.initialize_model_parallel(TP, PP)
    mpu.model_parallel_seed(1234)
    config = common.gpt2_config()
    created, new_group = [], dist.new_group

    def counting_new_group(*args, **kwargs):
        created.append(list(kwargs.get("ranks", args[0] if args else [])))
        return new_group(*args, **kwargs)

    dist.new_group = counting_new_group
    try:
        groups = dict(parallel_state=state) if handed else dict(topology=state.topology)
        engine, loss = _train_one_batch(GPT2ModelPipe(config, **groups), state, config, mpu)
    finally:
        dist.new_group = new_group
    grid, tied = engine.grid, engine.module.tied_comms["embed"]
    same = {"grid": grid is state.grid(), "tensor": grid.get_slice_parallel_group() is state.tp_group,
            "pipe": grid.get_pipe_parallel_group() is state.pp_group,
            "data": grid.get_data_parallel_group() is state.dp_group,
            "model": grid.get_model_parallel_group() is state.mp_group,
            "p2p": engine.p2p.group is state.pp_group, "tied": tied["group"] is state.subgroup(tied["ranks"])}
    mpu.destroy_model_parallel()
    dist.barrier()
    return {"created": created, "same": same, "loss": loss, "mp_ranks": state.mp_ranks}


@pytest.mark.long
def test_engine_groups_are_the_parallel_state_groups():
    handed = run_distributed(_engine_rank, TP * PP * DP, True, timeout=300)
    own = run_distributed(_engine_rank, TP * PP * DP, False, timeout=300)
    for rank, r in enumerate(handed):
        assert r["created"] == [], f"rank {rank} created groups after start-up: {r['created']}"
        assert all(r["same"].values()), f"rank {rank}: {r['same']}"
    assert handed[0]["mp_ranks"] == [0, 1, 4, 5] and handed[2]["mp_ranks"] == [2, 3, 6, 7]
    assert all(r["created"] and not any(r["same"].values()) for r in own), [r["same"] for r in own]
    assert [r["loss"] for r in handed] == [r["loss"] for r in own]
