"""Start-up of a training process: torch.distributed, the parallel groups, the random number generators
(`mpu.set_random_seed`; `mpu.rng_states` / `mpu.set_rng_states` capture and restore them for checkpoints).
`mpu.shutdown_distributed` is the matching exit."""
from __future__ import annotations

import warnings

import torch.distributed as dist

from megatron import mpu
from megatron.errors import UserError
from tds import device as tds_device


def initialize_megatron(cfg) -> mpu.ParallelState:
    """Check the machine can run the precision asked for, then initialise torch.distributed from the
    launcher's environment, build the groups, seed everything (`cfg`: a RunConfig)."""
    check_precision_supported(cfg.precision)
    layout = cfg.layout
    # DeepSpeed 0.19's ZeRO-1 calls an all-gather that torch 2.13 marks deprecated, once per step and rank.
    warnings.filterwarnings("ignore", message=r".*all_gather_into_tensor.* is deprecated", category=FutureWarning)
    timeout_s = 60 * layout.distributed_timeout_minutes
    tds_device.init_distributed(timeout_s=timeout_s)
    world = dist.get_world_size()
    if world != layout.world_size:
        raise ValueError(f"the arguments were resolved for world size {layout.world_size} but torch.distributed "
                         f"has {world} ranks")
    state = mpu.initialize_model_parallel(layout.tp, layout.pp, timeout_s, layout.ep)
    mpu.set_random_seed(cfg.seed, state.pp_rank)
    return state


def check_precision_supported(precision) -> None:
    """--fp16 where DeepSpeed's CPU accelerator refuses it (no GPU, and a CPU without oneDNN fp16 kernels:
    `torch.ops.mkldnn._is_mkldnn_fp16_supported()` is False, e.g. AMD EPYC) is a one-line UserError before any
    process group exists, instead of DeepSpeed's ValueError in `initialize` on every rank. It runs on the
    machine that trains, not in `megatron.config.preflight` (which may run on another machine, and imports no
    DeepSpeed)."""
    if not precision.fp16 or tds_device.is_cuda():
        return
    from deepspeed.accelerator import get_accelerator
    if not get_accelerator().is_fp16_supported():
        raise UserError("--fp16 (command line or DeepSpeed config) needs fp16 support, which this CPU lacks "
                        "(DeepSpeed's CPU accelerator follows torch.ops.mkldnn._is_mkldnn_fp16_supported(), False "
                        "here); train with --bf16, or in fp32 without --fp16")
