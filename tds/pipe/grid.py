"""The process grid of a pipeline model: DeepSpeed's `PipelineParallelGrid` interface over groups built once.

DeepSpeed's engine, ZeRO-1, the fp16/bf16 optimizers and tds read the groups through that interface
(`get_data_parallel_group()`, `get_slice_parallel_rank()`, `get_model_parallel_group()`, ...). For the
(pipe, data, model) topology of world size 8 with pp = dp = tp = 2 (`rank_lists`):

    tensor  [0, 1] [2, 3] [4, 5] [6, 7]      the topology's 'model' axis, DeepSpeed's "slice" groups
    pipe    [0, 4] [1, 5] [2, 6] [3, 7]      stage to stage: the loss broadcast and point-to-point
    data    [0, 2] [1, 3] [4, 6] [5, 7]      gradient all-reduce
    model   [0, 1, 4, 5] [2, 3, 6, 7]        pipe x tensor, one model replica: the gradient norm, overflow

"Model parallel" means that last kind here and in DeepSpeed's grid interface (`get_model_parallel_*`);
tensor parallelism is always called tensor (or DeepSpeed's "slice").

Expert parallelism (a mixture of experts' layers) folds E_p = expert-parallel size ranks out of each stage's tp x dp
ranks, in rank order (Megatron's expert layout with expert tensor parallelism 1; `expert_rank_lists`): at world 8,
pp = 2, tp = 2, dp = 2 and E_p = 2,

    expert          [0, 1] [2, 3] [4, 5] [6, 7]      each rank holds E / E_p experts; tokens move by all-to-all
    expert data     [0, 2] [1, 3] [4, 6] [5, 7]      the ranks holding the same experts: their gradient all-reduce
    expert model    [0, 1, 4, 5] [2, 3, 6, 7]        one copy of every expert of every stage: their gradient norm

`ProcessGrid` creates no group: it is a view of groups handed to it, one of each kind (the kinds are checked
against the topology's rank lists), plus `subgroup(ranks)` for the groups a model adds (its tied weights). A
program that owns its groups (Megatron's `ParallelState`) hands them with `PipelineModule(..., grid=...)`.
`build_grid(topology)` is where tds creates groups itself, for a program that hands none (a plain DeepSpeed
program): every rank list of every kind, once.
"""
from __future__ import annotations

from typing import Callable, Dict, List, Optional

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipelineParallelGrid, ProcessTopology


def rank_lists(topology: ProcessTopology) -> Dict[str, List[List[int]]]:
    """{kind: every group of that kind as its sorted global ranks} (see the module docstring). A topology
    without a 'model' axis has one-rank tensor groups, as DeepSpeed's grid."""
    tensor = topology.get_axis_comm_lists("model") or [[r] for r in range(topology.world_size())]
    model = [sorted(topology.get_axis_list("data", d)) for d in range(max(topology.get_dim("data"), 1))]
    return {"tensor": tensor, "pipe": topology.get_axis_comm_lists("pipe"),
            "data": topology.get_axis_comm_lists("data"), "model": model}


def expert_rank_lists(topology: ProcessTopology, expert_parallel_size: int) -> Dict[str, List[List[int]]]:
    """{'expert', 'expert_data', 'expert_model'}: every group of each kind (module docstring). Each stage's tp x dp
    ranks are consecutive in the (pipe, data, model) topology; within them rank i has expert-parallel rank i % E_p
    and expert-data-parallel rank i // E_p."""
    ep, stages = expert_parallel_size, max(topology.get_dim("pipe"), 1)
    per_stage = topology.world_size() // stages
    if ep < 1 or per_stage % ep:
        raise ValueError(f"--expert-model-parallel-size {ep} does not divide the {per_stage} ranks of a pipeline "
                         f"stage (tensor-parallel x data-parallel size)")
    edp = per_stage // ep
    expert = [[s * per_stage + j * ep + e for e in range(ep)] for s in range(stages) for j in range(edp)]
    expert_data = [[s * per_stage + j * ep + e for j in range(edp)] for s in range(stages) for e in range(ep)]
    expert_model = [[s * per_stage + j * ep + e for s in range(stages) for e in range(ep)] for j in range(edp)]
    return {"expert": expert, "expert_data": expert_data, "expert_model": expert_model}


class ProcessGrid(PipelineParallelGrid):
    """DeepSpeed's PipelineParallelGrid over handed groups (see the module docstring): `tensor`, `pipe`, `data`,
    `model` are this rank's group of each kind, `subgroup(ranks)` returns a group of other ranks (a collective:
    every rank asks for the same lists in the same order). All of DeepSpeed's grid methods work unchanged.
    `experts`: {'expert', 'expert_data', 'expert_model'} -> this rank's group of each kind where experts are spread
    over more than one rank (`expert_rank_lists`), else None."""

    def __init__(self, topology: ProcessTopology, *, tensor, pipe, data, model, subgroup: Callable,
                 experts: Optional[Dict[str, object]] = None):
        # PipelineParallelGrid's attributes without its constructor, which would build every group again
        self._topo, self.global_rank, self.world_size = topology, dist.get_rank(), dist.get_world_size()
        if topology.world_size() != self.world_size:
            raise ValueError(f"the topology has {topology.world_size()} ranks but torch.distributed has "
                             f"{self.world_size}: {topology}")
        self.data_parallel_size = max(topology.get_dim("data"), 1)
        self.pipe_parallel_size = max(topology.get_dim("pipe"), 1)
        self.model_parallel_size = self.slice_parallel_size = max(topology.get_dim("model"), 1)
        self.stage_id, self.data_parallel_id = self.get_stage_id(), self.get_data_parallel_id()
        self.is_first_stage = self.stage_id == 0
        self.is_last_stage = self.stage_id == self.pipe_parallel_size - 1
        self.p2p_groups = self._build_p2p_groups()
        lists = rank_lists(topology)
        self.dp_groups, self.pipe_groups = lists["data"], lists["pipe"]
        self.slice_proc_group, self.slice_group = tensor, self._mine("tensor", tensor, lists)
        if self.model_parallel_size > 1:  # as DeepSpeed's grid (nothing reads them)
            self.mp_group, self.model_groups = [], lists["tensor"]
        self.pp_proc_group, self.pp_group = pipe, self._mine("pipe", pipe, lists)
        self.dp_proc_group, self.dp_group = data, self._mine("data", data, lists)
        self.ds_model_proc_group, model_ranks = model, self._mine("model", model, lists)
        self.ds_model_rank, self.ds_model_world_size = model_ranks.index(self.global_rank), len(model_ranks)
        self.subgroup = subgroup
        self.experts = experts

    def _mine(self, kind: str, group, lists: dict) -> List[int]:
        """This rank's list of `kind`, checked to be the ranks of the handed group."""
        (ranks,) = [r for r in lists[kind] if self.global_rank in r]
        held = dist.get_process_group_ranks(group)
        if sorted(held) != ranks:
            raise ValueError(f"the {kind} group handed to the grid holds ranks {held}, but the topology puts rank "
                             f"{self.global_rank} in the {kind} group {ranks}")
        return ranks


def build_grid(topology: ProcessTopology) -> ProcessGrid:
    """tds's own groups for `topology`, for a program that hands none: every rank list of every kind (each rank
    builds every group, in the same order, as torch.distributed requires); later subgroups are new groups."""
    me, mine = dist.get_rank(), {}
    for kind, lists in rank_lists(topology).items():
        for ranks in lists:
            group = dist.new_group(ranks)
            if me in ranks:
                mine[kind] = group
    return ProcessGrid(topology, subgroup=dist.new_group, **mine)
