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
from megatron.errors import UserError
from tds import device as tds_device


def initialize_megatron(args: argparse.Namespace) -> mpu.ParallelState:
    """Check the machine can run the precision asked for, then initialise torch.distributed from the
    launcher's environment, build the groups, seed everything."""
    check_precision_supported(args)
    # DeepSpeed 0.19's ZeRO-1 calls an all-gather that torch 2.13 marks deprecated, once per step and rank.
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    timeout_s = 60 * args.distributed_timeout_minutes
    tds_device.init_distributed(timeout_s=timeout_s)
    world = dist.get_world_size()
    if world != args.world_size:
        raise ValueError(f"the arguments were resolved for world size {args.world_size} but torch.distributed "
                         f"has {world} ranks")
    state = mpu.initialize_model_parallel(args.tensor_model_parallel_size, args.pipe_parallel_size, timeout_s)
    set_random_seed(args.seed, state.pp_rank)
    return state


def check_precision_supported(args: argparse.Namespace) -> None:
    """--fp16 where DeepSpeed's CPU accelerator refuses it (no GPU, and a CPU without oneDNN fp16 kernels:
    `torch.ops.mkldnn._is_mkldnn_fp16_supported()` is False, e.g. AMD EPYC) is a one-line UserError before any
    process group exists, instead of DeepSpeed's ValueError in `initialize` on every rank. It runs on the
    machine that trains, not in `megatron.preflight` (which may run on another machine, and imports no
    DeepSpeed)."""
    if not args.fp16 or tds_device.is_cuda():
        return
    from deepspeed.accelerator import get_accelerator
    if not get_accelerator().is_fp16_supported():
        raise UserError("--fp16 (command line or DeepSpeed config) needs fp16 support, which this CPU lacks "
                        "(DeepSpeed's CPU accelerator follows torch.ops.mkldnn._is_mkldnn_fp16_supported(), False "
                        "here); train with --bf16, or in fp32 without --fp16")


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


def shutdown_distributed(wait: bool = True) -> None:
    """Leave torch.distributed in order at the end of a launched process: with `wait`, once every rank got here
    (not on an error path, where peers may be elsewhere), then destroy the groups. A process that exits with live
    gloo groups whose peers have already gone can abort in their destructors (SIGABRT: "terminate called
    without an active exception"), which the launcher reports as a failed run."""
    if not dist.is_initialized():
        return
    if wait:
        dist.barrier()
    mpu.destroy_model_parallel()
    dist.destroy_process_group()
