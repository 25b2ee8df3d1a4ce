"""Process layout of the inference tools: tensor parallel (tp) x data parallel (dp), no pipeline.

    world = tp x dp          tp ranks split the model (Megatron layers); dp replicas split the work
    python tools/x.py ...                                  one process: tp = dp = 1, no torch.distributed
    torchrun --nproc_per_node 4 tools/x.py --tensor-model-parallel-size 2 ...   tp = 2, dp = 2

The ranks are laid out as in training (`mpu.initialize_model_parallel`, tensor-parallel ranks adjacent).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional

import torch.distributed as dist

from megatron import mpu
from megatron.errors import UserError
from megatron.mpu import shutdown_distributed


@dataclass(frozen=True)
class Parallel:
    tp_group: Optional[Any]
    tp_size: int
    dp_rank: int
    dp_size: int
    global_rank: int = 0
    owns_process_group: bool = False  # created by `setup`, so `close` destroys it

    @classmethod
    def single(cls) -> "Parallel":
        return cls(None, 1, 0, 1)

    @classmethod
    def from_state(cls, state: mpu.ParallelState, owns_process_group: bool = False) -> "Parallel":
        return cls(state.tp_group, state.dims.tp, state.dp_rank, state.dims.dp, state.global_rank,
                   owns_process_group)

    def close(self, wait: bool = True) -> None:
        """Destroy the process group if `setup` created it (a launched process that exits with a live gloo
        group aborts); with `wait`, after every rank got there (not on an error path: peers may be elsewhere)."""
        if self.owns_process_group:
            shutdown_distributed(wait)

    @property
    def is_first(self) -> bool:
        """Global rank 0: the rank that prints and writes files."""
        return self.global_rank == 0

    def all_gather_objects(self, items: List[Any]) -> List[Any]:
        """Every rank's `items`, concatenated in rank order (only this list when single-process)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return list(items)
        parts: List[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, items)
        return [x for part in parts for x in part]

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's `obj` on every rank (e.g. a line read from the terminal)."""
        if not dist.is_initialized() or dist.get_world_size() == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


def setup(tp: int) -> Parallel:
    """Join the launcher's processes (if any) and build the tp x dp groups; pp is always 1."""
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized() and launched == 1:
        if tp != 1:
            raise UserError(f"--tensor-model-parallel-size {tp} needs {tp} processes (or a multiple): run with "
                            f"torchrun --nproc_per_node {tp} ...")
        return Parallel.single()
    from tds import device as tds_device
    owns = not dist.is_initialized()
    tds_device.init_distributed()
    world = dist.get_world_size()
    if tp < 1 or world % tp:
        raise UserError(f"--tensor-model-parallel-size {tp} does not divide the {world} processes launched; "
                        f"launch a multiple of {tp} processes or change the size")
    return Parallel.from_state(mpu.initialize_model_parallel(tp, 1), owns)


@contextmanager
def launched(tp: int) -> Iterator[Parallel]:
    """`setup(tp)`, and the process group destroyed on the way out."""
    par = setup(tp)
    try:
        yield par
    except BaseException:
        par.close(wait=False)
        raise
    par.close()
