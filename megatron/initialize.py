"""Start-up of a training process: torch.distributed, the parallel groups, the random number generators.

Seeding (Megatron): python, numpy, torch's CPU generator and the device generator of pipeline stage
`pp_rank` start from seed + 100 * pp_rank; the tensor-parallel tracker adds its per-tp-rank stream
(`mpu.model_parallel_seed`). `rng_states()` / `set_rng_states()` capture and restore all of them for
checkpoints. The models' weight initialisation and dropout do not draw from these generators
(megatron/model/rng.py: dropout masks are a pure function of seed, iteration, micro-batch and site), so
they are the same in every layout and need nothing saved.
"""
from __future__ import annotations

import argparse
import random
import warnings
from typing import Any, Dict

import numpy as np
import torch
import torch.distributed as dist

from megatron import mpu
from tds import device as tds_device


def initialize_megatron(args: argparse.Namespace) -> mpu.ParallelState:
    """Initialise torch.distributed from the launcher's environment, build the groups, seed everything."""
    # DeepSpeed 0.19's ZeRO-1 calls an all-gather that torch 2.13 marks deprecated, once per step and rank.
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    tds_device.init_distributed()
    world = dist.get_world_size()
    if world != args.world_size:
        raise ValueError(f"the arguments were resolved for world size {args.world_size} but torch.distributed "
                         f"has {world} ranks")
    state = mpu.initialize_model_parallel(args.tensor_model_parallel_size, args.pipe_parallel_size)
    set_random_seed(args.seed, state.pp_rank)
    return state


def set_random_seed(seed: int, pp_rank: int = 0) -> None:
    """Seed python, numpy, torch (CPU), the device generator and the tensor-parallel tracker."""
    seed = seed + 100 * pp_rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    mpu.model_parallel_seed(seed)


def rng_states() -> Dict[str, Any]:
    return dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
                device=tds_device.get_rng_state(), tracker=mpu.get_rng_tracker().get_states())


def set_rng_states(states: Dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    tds_device.set_rng_state(states["device"])
    mpu.get_rng_tracker().set_states(states["tracker"])
