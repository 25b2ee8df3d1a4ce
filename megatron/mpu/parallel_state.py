"""Process groups for tensor (model), pipeline and data parallelism, built from one topology.

The rank layout is DeepSpeed's `PipeModelDataParallelTopology`: axes ('pipe', 'data', 'model') with 'model'
varying fastest, so DeepSpeed's engine, the TDS pipeline engine and the Megatron layers all see the same
groups. For world size 8 with tp=2, pp=2 (so dp=2):

    tensor (model) groups:  [0, 1] [2, 3] [4, 5] [6, 7]
    data groups:            [0, 2] [1, 3] [4, 6] [5, 7]
    pipeline groups:        [0, 4] [1, 5] [2, 6] [3, 7]

Everything lives on one `ParallelState` object; the Megatron-style accessors (`get_model_parallel_rank()`
and friends) read the current one, for code ported from Megatron. New code should pass the state or its
groups explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology


@dataclass(frozen=True)
class ParallelDims:
    """tp * pp * dp == world_size, validated at construction."""
    world_size: int
    tp: int = 1
    pp: int = 1

    def __post_init__(self):
        for name, v in (("tensor-model-parallel size", self.tp), ("pipeline-parallel size", self.pp)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.world_size % (self.tp * self.pp) != 0:
            raise ValueError(f"world size {self.world_size} is not divisible by tensor-model-parallel size "
                             f"{self.tp} x pipeline-parallel size {self.pp} = {self.tp * self.pp}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)


@dataclass
class ParallelState:
    """This process's coordinates and groups in the (pipe, data, model) grid."""
    dims: ParallelDims
    topology: PipeModelDataParallelTopology
    global_rank: int
    tp_group: Optional[dist.ProcessGroup]
    pp_group: Optional[dist.ProcessGroup]
    dp_group: Optional[dist.ProcessGroup]
    tp_ranks: list
    pp_ranks: list
    dp_ranks: list

    @property
    def coord(self):
        return self.topology.get_coord(self.global_rank)

    @property
    def tp_rank(self) -> int:
        return self.coord.model

    @property
    def pp_rank(self) -> int:
        return self.coord.pipe

    @property
    def dp_rank(self) -> int:
        return self.coord.data


_STATE: Optional[ParallelState] = None


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              timeout_s: Optional[float] = None) -> ParallelState:
    """Build every group (collective: all ranks must call it) and make it the current state. With `timeout_s`
    a collective on these groups that waits longer fails (torch's default is 30 minutes)."""
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before initialize_model_parallel()")
    dims = ParallelDims(dist.get_world_size(), tensor_model_parallel_size, pipeline_model_parallel_size)
    topo = PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp)
    me = dist.get_rank()
    mine = {}
    for axis in ("model", "pipe", "data"):
        for ranks in topo.get_axis_comm_lists(axis):  # same order on every rank, as new_group requires
            group = dist.new_group(ranks, timeout=None if timeout_s is None else timedelta(seconds=timeout_s))
            if me in ranks:
                mine[axis] = (group, ranks)
    _STATE = ParallelState(dims, topo, me, mine["model"][0], mine["pipe"][0], mine["data"][0],
                           mine["model"][1], mine["pipe"][1], mine["data"][1])
    return _STATE


def set_parallel_state(state: Optional[ParallelState]) -> None:
    global _STATE
    _STATE = state


def destroy_model_parallel() -> None:
    set_parallel_state(None)


def model_parallel_is_initialized() -> bool:
    return _STATE is not None


def get_parallel_state() -> ParallelState:
    if _STATE is None:
        raise RuntimeError("model parallel groups are not initialised: call mpu.initialize_model_parallel()")
    return _STATE


def get_topology() -> PipeModelDataParallelTopology:
    return get_parallel_state().topology


# Megatron-compatible accessors. Before initialisation (or without torch.distributed) every axis has size 1,
# so layers also run in a plain single process.
def _axis(name: str):
    if _STATE is None:
        return None, 0, 1
    s = _STATE
    group, ranks = {"tp": (s.tp_group, s.tp_ranks), "pp": (s.pp_group, s.pp_ranks),
                    "dp": (s.dp_group, s.dp_ranks)}[name]
    return group, ranks.index(s.global_rank), len(ranks)


def get_model_parallel_group():
    return _axis("tp")[0]


def get_model_parallel_rank() -> int:
    return _axis("tp")[1]


def get_model_parallel_world_size() -> int:
    return _axis("tp")[2]


def get_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this process's tensor-parallel group."""
    return _STATE.tp_ranks[0] if _STATE is not None else 0


get_tensor_model_parallel_group = get_model_parallel_group
get_tensor_model_parallel_rank = get_model_parallel_rank
get_tensor_model_parallel_world_size = get_model_parallel_world_size
get_tensor_model_parallel_src_rank = get_model_parallel_src_rank


def get_data_parallel_group():
    return _axis("dp")[0]


def get_data_parallel_rank() -> int:
    return _axis("dp")[1]


def get_data_parallel_world_size() -> int:
    return _axis("dp")[2]


def get_pipe_parallel_group():
    return _axis("pp")[0]


def get_pipe_parallel_rank() -> int:
    return _axis("pp")[1]


def get_pipe_parallel_world_size() -> int:
    return _axis("pp")[2]


get_pipeline_model_parallel_group = get_pipe_parallel_group
get_pipeline_model_parallel_rank = get_pipe_parallel_rank
get_pipeline_model_parallel_world_size = get_pipe_parallel_world_size


def shutdown_distributed(wait: bool = True) -> None:
    """Leave torch.distributed in order at the end of a launched process: with `wait`, once every rank got here
    (not on an error path, where peers may be elsewhere), then destroy the groups. A process that exits with live
    gloo groups whose peers have already gone can abort in their destructors (SIGABRT: "terminate called
    without an active exception"), which the launcher reports as a failed run."""
    if not dist.is_initialized():
        return
    if wait:
        dist.barrier()
    destroy_model_parallel()
    dist.destroy_process_group()
