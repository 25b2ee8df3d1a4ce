"""Process groups for tensor, pipeline and data parallelism, built once, from one topology.

The rank layout is DeepSpeed's `PipeModelDataParallelTopology`: axes ('pipe', 'data', 'model') with 'model'
(tensor) varying fastest. `initialize_model_parallel` builds every group the program uses, once, here; for
world size 8 with tp=2, pp=2 (so dp=2):

    tensor groups:            [0, 1] [2, 3] [4, 5] [6, 7]
    pipeline groups:          [0, 4] [1, 5] [2, 6] [3, 7]      (also the point-to-point transport's)
    data groups:              [0, 2] [1, 3] [4, 6] [5, 7]
    model groups (pp x tp):   [0, 1, 4, 5] [2, 3, 6, 7]        one model replica: gradient norm, overflow
    embedding groups:         [0, 4] [1, 5] [2, 6] [3, 7]      first and last stage (pp > 1): tied embeddings

With expert parallelism (`expert_model_parallel_size` E_p > 1: a mixture of experts' layers) three more kinds, folded
out of each stage's tp x dp ranks (`tds.pipe.grid.expert_rank_lists`; here E_p = 2):

    expert groups:            [0, 1] [2, 3] [4, 5] [6, 7]      the experts' all-to-all / all-gather
    expert data groups:       [0, 2] [1, 3] [4, 6] [5, 7]      the same experts: their gradient all-reduce
    expert model groups:      [0, 1, 4, 5] [2, 3, 6, 7]        every expert once: their gradient norm

The embedding groups (Megatron's) are groups of their own even where, as here at pp = 2, they hold the ranks
of a pipeline group: their all-reduce runs while point-to-point transfers on the pipeline group are in flight.

"Model parallel" means pipe x tensor (one model replica), as in DeepSpeed's grid and Megatron core; tensor
parallelism is called tensor. `ParallelState.grid()` is the pipeline engine's view of these groups (a
`tds.pipe.ProcessGrid`, no group of its own); `subgroup(ranks)` gives a model the groups of its tied weights
(the embedding groups, or a group built here for any other rank list). Everything lives on one
`ParallelState`, handed to the models, loaders, batch functions and the engine. The module-level accessors
(`get_tensor_model_parallel_rank()` and friends) read the current state, for code written against Megatron's
mpu API; Megatron's older `get_model_parallel_*` names are kept as aliases of the tensor-parallel ones for
such code (they mean tensor there, as in Megatron 2019).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta
from typing import Dict, Optional, Sequence, Tuple

import torch.distributed as dist
from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

from tds.pipe.grid import ProcessGrid, expert_rank_lists, rank_lists


@dataclass(frozen=True)
class ParallelDims:
    """tp * pp * dp == world_size, and the expert-parallel size ep divides tp * dp, validated at construction."""
    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self):
        for name, v in (("tensor-model-parallel size", self.tp), ("pipeline-parallel size", self.pp)):
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v}")
        if self.world_size % (self.tp * self.pp) != 0:
            raise ValueError(f"world size {self.world_size} is not divisible by tensor-model-parallel size "
                             f"{self.tp} x pipeline-parallel size {self.pp} = {self.tp * self.pp}")
        if self.ep < 1 or (self.tp * self.dp) % self.ep:
            raise ValueError(f"expert-model-parallel size {self.ep} does not divide tensor-model-parallel size "
                             f"{self.tp} x data-parallel size {self.dp} = {self.tp * self.dp}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)


@dataclass
class ParallelState:
    """This process's coordinates and groups in the (pipe, data, model) grid; `mp` is pipe x tensor."""
    dims: ParallelDims
    topology: PipeModelDataParallelTopology
    global_rank: int
    tp_group: Optional[dist.ProcessGroup]
    pp_group: Optional[dist.ProcessGroup]
    dp_group: Optional[dist.ProcessGroup]
    mp_group: Optional[dist.ProcessGroup]
    tp_ranks: list
    pp_ranks: list
    dp_ranks: list
    mp_ranks: list
    timeout_s: Optional[float] = None
    experts: Optional[Dict[str, Tuple[dist.ProcessGroup, list]]] = None  # kind -> (group, ranks) where ep > 1
    _subgroups: Dict[Tuple[int, ...], dist.ProcessGroup] = field(default_factory=dict, repr=False)
    _grid: Optional[ProcessGrid] = field(default=None, repr=False)

    @property
    def ep_group(self) -> Optional[dist.ProcessGroup]:
        """The expert-parallel group of this rank (None: every rank holds all experts)."""
        return None if self.experts is None else self.experts["expert"][0]

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

    def subgroup(self, ranks: Sequence[int]) -> dist.ProcessGroup:
        """The group of `ranks` a model adds (the stages that share a tied weight), built on first use and kept.
        A collective on first use: every rank asks for the same lists in the same order."""
        key = tuple(ranks)
        if key not in self._subgroups:
            self._subgroups[key] = _new_group(list(key), self.timeout_s)
        return self._subgroups[key]

    def grid(self) -> ProcessGrid:
        """The pipeline engine's and DeepSpeed's view of these groups (one per state; it builds none)."""
        if self._grid is None:
            self._grid = ProcessGrid(self.topology, tensor=self.tp_group, pipe=self.pp_group, data=self.dp_group,
                                     model=self.mp_group, subgroup=self.subgroup,
                                     experts=None if self.experts is None else
                                     {kind: group for kind, (group, _) in self.experts.items()})
        return self._grid


_STATE: Optional[ParallelState] = None


def _new_group(ranks: list, timeout_s: Optional[float]) -> dist.ProcessGroup:
    """The one place megatron creates a process group."""
    return dist.new_group(ranks, timeout=None if timeout_s is None else timedelta(seconds=timeout_s))


def initialize_model_parallel(tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                              timeout_s: Optional[float] = None, expert_model_parallel_size: int = 1
                              ) -> ParallelState:
    """Build every group (collective: all ranks must call it) and make it the current state. With `timeout_s`
    a collective on these groups that waits longer fails (torch's default is 30 minutes)."""
    global _STATE
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed must be initialised before initialize_model_parallel()")
    dims = ParallelDims(dist.get_world_size(), tensor_model_parallel_size, pipeline_model_parallel_size,
                        expert_model_parallel_size)
    topo = PipeModelDataParallelTopology(num_pp=dims.pp, num_mp=dims.tp, num_dp=dims.dp)
    me = dist.get_rank()
    mine = {}
    kinds = {**rank_lists(topo), **(expert_rank_lists(topo, dims.ep) if dims.ep > 1 else {})}
    for kind, lists in kinds.items():
        for ranks in lists:  # same order on every rank, as new_group requires
            group = _new_group(ranks, timeout_s)
            if me in ranks:
                mine[kind] = (group, ranks)
    kinds = ("tensor", "pipe", "data", "model")
    experts = {k: mine[k] for k in ("expert", "expert_data", "expert_model")} if dims.ep > 1 else None
    _STATE = ParallelState(dims, topo, me, *(mine[k][0] for k in kinds), *(mine[k][1] for k in kinds),
                           timeout_s=timeout_s, experts=experts)
    for line in topo.get_axis_comm_lists("pipe") if dims.pp > 1 else []:
        _STATE.subgroup([line[0], line[-1]])  # the embedding groups, kept for the models' tied embeddings
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


def get_tensor_model_parallel_group():
    return _axis("tp")[0]


def get_tensor_model_parallel_rank() -> int:
    return _axis("tp")[1]


def get_tensor_model_parallel_world_size() -> int:
    return _axis("tp")[2]


def get_tensor_model_parallel_src_rank() -> int:
    """Global rank of tensor-parallel rank 0 in this process's tensor-parallel group."""
    return _STATE.tp_ranks[0] if _STATE is not None else 0


# Megatron 2019's names for the tensor-parallel accessors, for code ported from it (they mean tensor there; in
# this project "model parallel" is pipe x tensor, `ParallelState.mp_group`).
get_model_parallel_group = get_tensor_model_parallel_group
get_model_parallel_rank = get_tensor_model_parallel_rank
get_model_parallel_world_size = get_tensor_model_parallel_world_size
get_model_parallel_src_rank = get_tensor_model_parallel_src_rank


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
