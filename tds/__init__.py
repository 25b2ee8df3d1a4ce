"""TDS: DeepSpeed with a corrected pipeline engine. Use it as `import tds as deepspeed`.

Every attribute of the `deepspeed` module is reachable as `tds.<name>` (the names below, and any other through
the module-level `__getattr__`), except those that TDS replaces:
- `initialize` builds `tds.pipe.PipelineEngine` for a `tds.pipe.PipelineModule`, DeepSpeed's engine otherwise;
- `init_distributed` is DeepSpeed's, minus the JIT build of its CPU shared-memory op (see `tds.device`);
- `pipe` is `tds.pipe` (PipelineModule with the declared stage-boundary layout, PipelineEngine, schedules), and
  `PipelineModule` / `PipelineEngine` are its classes.

On a machine with no accelerator device file, DeepSpeed's accelerator is named cpu (DS_ACCELERATOR) before DeepSpeed
is imported, so it picks the CPU without warning that it may have missed a GPU (a user's DS_ACCELERATOR is kept;
megatron/__init__.py does the same for the project's tools).

DeepSpeed, torch and the engine load with the first name that needs them, not with `import tds` (`tds/lazy.py`):
the schedules as data (`tds.pipe.instructions`, `tds.pipe.schedule_sim`) import without them.
"""
from __future__ import annotations

import glob as _glob
import os as _os
from typing import Any

from .lazy import lazy_exports

if "DS_ACCELERATOR" not in _os.environ and not any(
        _glob.glob(p) for p in ("/dev/nvidia*", "/dev/kfd", "/dev/dri", "/dev/davinci*", "/dev/accel*", "/dev/hl*")):
    _os.environ["DS_ACCELERATOR"] = "cpu"

REPLACED = ("initialize", "init_distributed", "pipe", "PipelineEngine", "PipelineModule")  # differ from deepspeed's
_OWN = {"init_distributed": "tds.device", "make_safe": "tds.safe_load", "PipelineEngine": "tds.pipe",
        "PipelineModule": "tds.pipe", "sized_reduce_buckets": "tds.pipe.zero_buckets"}


def _deepspeed_attribute(name: str) -> Any:
    """Any other attribute of `deepspeed` (init_inference, log_dist, DeepSpeedTransformerLayer, ...)."""
    import deepspeed
    try:
        return getattr(deepspeed, name)
    except AttributeError:
        raise AttributeError(f"module 'tds' (and 'deepspeed') has no attribute {name!r}") from None


__getattr__ = lazy_exports(__name__, _OWN, _deepspeed_attribute)


def __dir__() -> list:
    import deepspeed
    return sorted(set(globals()) | set(_OWN) | {"pipe", "device", "safe_load"} | set(dir(deepspeed)))


__all__ = ["initialize", "init_distributed", "add_config_arguments", "checkpointing", "pipe", "utils",
           "DeepSpeedEngine", "PipelineEngine", "PipelineModule", "DeepSpeedConfig", "zero", "comm"]


def initialize(args: Any = None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, mpu=None, dist_init_required: bool | None = None, collate_fn=None,
               config=None, config_params=None, checkpoint_engine_wrap=None, **kwargs):
    """deepspeed.initialize with the TDS engine for pipeline models; returns (engine, optimizer, loader, sched).

    `checkpoint_engine_wrap`: a callable given the engine's checkpoint engine (DeepSpeed's, reading safely:
    `tds.safe_load`) that returns the one the engine reads and writes checkpoint files through (a program's own
    checks around every file); None keeps it.

    For a `tds.pipe.PipelineModule` the engine's process groups are the module's grid (`tds.pipe.grid`: the
    groups handed to the module, or built by tds from its topology; its "model parallel" group spans pipe x
    tensor ranks as DeepSpeed's grad-norm and overflow checks need); a user `mpu` is only checked against it
    (same tensor- and data-parallel sizes and ranks). ZeRO stages 2 and 3 are refused.
    """
    import deepspeed as _ds
    from deepspeed import DeepSpeedConfig
    from deepspeed.runtime.pipe.module import PipelineModule as _DSPipelineModule

    from .device import init_distributed
    from .pipe import PipelineEngine, PipelineModule
    from .pipe.zero_buckets import sized_reduce_buckets
    from .safe_load import make_safe
    if model is None:
        raise ValueError("tds.initialize needs a model")
    if not isinstance(model, _DSPipelineModule):
        out = _ds.initialize(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                             training_data=training_data, lr_scheduler=lr_scheduler, mpu=mpu,
                             dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                             config_params=config_params, **kwargs)
        make_safe(out[0])  # its checkpoint reads: weights_only=True and the allowlist (tds.safe_load)
        if checkpoint_engine_wrap is not None:
            out[0].checkpoint_engine = checkpoint_engine_wrap(out[0].checkpoint_engine)
        return out
    if not isinstance(model, PipelineModule):
        raise TypeError(f"{type(model).__name__} is DeepSpeed's own PipelineModule; build it from "
                        f"tds.pipe.PipelineModule (with `import tds as deepspeed`, deepspeed.pipe.PipelineModule)")
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config
    init_distributed(dist_backend=get_accelerator().communication_backend_name(),
                     dist_init_required=dist_init_required)
    config = _resolve_config(args, config if config is not None else config_params, load_ds_config)
    config = sized_reduce_buckets(config, model)  # ZeRO-1's buckets no larger than this rank's gradients
    grid = model.mpu()
    if mpu is not None:
        _check_mpu(mpu, grid)
    config_class = DeepSpeedConfig(config, grid)
    if config_class.zero_optimization_stage >= 2:
        raise ValueError(f"zero_optimization.stage={config_class.zero_optimization_stage} is not supported with "
                         f"pipeline parallelism (gradients must stay whole across micro-batches); use 0 or 1")
    _ds.set_optimizer_flags(config_class, model)
    engine = PipelineEngine(args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
                            training_data=training_data, lr_scheduler=lr_scheduler, mpu=grid,
                            dist_init_required=dist_init_required, collate_fn=collate_fn, config=config,
                            config_class=config_class, checkpoint_engine_wrap=checkpoint_engine_wrap)
    engine._configure_python_gc()
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _resolve_config(args, config, load_ds_config) -> dict:
    path = getattr(args, "deepspeed_config", None)
    if path is not None and config is not None:
        raise ValueError("give the DeepSpeed config either as args.deepspeed_config or as config=, not both")
    config = path if config is None else config
    if config is None:
        raise ValueError("tds.initialize needs a DeepSpeed config: config=dict/path or args.deepspeed_config")
    return config if isinstance(config, dict) else load_ds_config(config)


def _check_mpu(mpu, grid) -> None:
    """The user's mpu must describe the same tensor- and data-parallel groups as the module's grid. Its tensor
    size and rank are read as DeepSpeed does (`get_tensor_model_parallel_*`, else Megatron 2019's
    `get_model_parallel_*`, which meant tensor there)."""
    from deepspeed.utils.bwc import bwc_tensor_model_parallel_rank, bwc_tensor_model_parallel_world_size
    pairs = {"tensor-parallel world size": (bwc_tensor_model_parallel_world_size(mpu),
                                            grid.get_slice_parallel_world_size()),
             "tensor-parallel rank": (bwc_tensor_model_parallel_rank(mpu), grid.get_slice_parallel_rank()),
             "data-parallel world size": (mpu.get_data_parallel_world_size(), grid.get_data_parallel_world_size()),
             "data-parallel rank": (mpu.get_data_parallel_rank(), grid.get_data_parallel_rank())}
    bad = {k: v for k, v in pairs.items() if v[0] != v[1]}
    if bad:
        raise ValueError("mpu and the PipelineModule topology disagree ((mpu, topology) per item): "
                         f"{bad}; build the module with topology=PipeModelDataParallelTopology(num_pp, num_mp, "
                         f"num_dp) matching the mpu")
