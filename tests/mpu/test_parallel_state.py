"""Group layout agrees with DeepSpeed's PipeModelDataParallelTopology; bad sizes get one-line errors."""
import pytest
import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from megatron import mpu
from megatron.mpu.parallel_state import ParallelDims
from harness.dist import run_distributed


def _layout(tp, pp):
    state = mpu.initialize_model_parallel(tp, pp)
    out = dict(tp=state.tp_ranks, pp=state.pp_ranks, dp=state.dp_ranks,
               ranks=(mpu.get_model_parallel_rank(), mpu.get_pipe_parallel_rank(), mpu.get_data_parallel_rank()),
               sizes=(mpu.get_model_parallel_world_size(), mpu.get_pipe_parallel_world_size(),
                      mpu.get_data_parallel_world_size()),
               group_sizes=tuple(dist.get_world_size(g) for g in (state.tp_group, state.pp_group, state.dp_group)))
    mpu.destroy_model_parallel()
    return out


def test_world8_tp2_pp2_matches_deepspeed_topology():
    topo = PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=2)
    out = run_distributed(_layout, 8, 2, 2)
    for rank, o in enumerate(out):
        c = topo.get_coord(rank)
        for axis, key in (("model", "tp"), ("pipe", "pp"), ("data", "dp")):
            (group,) = [g for g in topo.get_axis_comm_lists(axis) if rank in g]
            assert o[key] == group
        assert o["ranks"] == (c.model, c.pipe, c.data)
        assert o["sizes"] == (2, 2, 2) == o["group_sizes"]
    assert out[0]["tp"] == [0, 1] and out[0]["dp"] == [0, 2] and out[0]["pp"] == [0, 4]


def test_accessors_default_to_single_process():
    assert (mpu.get_model_parallel_world_size(), mpu.get_model_parallel_rank()) == (1, 0)
    assert mpu.get_data_parallel_world_size() == 1 and mpu.get_pipe_parallel_world_size() == 1


@pytest.mark.parametrize("world,tp,pp,msg", [
    (8, 3, 1, r"world size 8 is not divisible by tensor-model-parallel size 3 x pipeline-parallel size 1 = 3"),
    (6, 2, 2, r"world size 6 is not divisible by .* = 4"),
    (4, 0, 1, r"tensor-model-parallel size must be >= 1, got 0"),
])
def test_bad_sizes_named(world, tp, pp, msg):
    with pytest.raises(ValueError, match=msg):
        ParallelDims(world, tp, pp)
