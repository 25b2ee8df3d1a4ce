"""The DeepSpeed config and the command line never silently disagree.

Settings that both can hold are listed once in `SHARED`: (argument, JSON path). Before the arguments are
resolved, `merge_json_into_args` copies JSON values into arguments left unset and raises on a value given in
both places that differs (naming both). After resolution, `build_ds_config` writes every resolved value back
into a copy of the JSON dict, which is what DeepSpeed receives. So `--zero-stage 1` reaches DeepSpeed even
with a JSON file that has no `zero_optimization` section (the bug of the original CPM-Pretrain).

Units: the JSON `fp16.loss_scale` 0 means dynamic (argument None); `fp16.initial_scale_power` p is the
argument `--initial-loss-scale` 2**p; `pipeline.timeout_s` is seconds, `--distributed-timeout-minutes` minutes.
"""
from __future__ import annotations

import argparse
import copy
import difflib
import json
import math
import re
from typing import Any, Dict, Optional, Tuple

from megatron.errors import UserError

SHARED: Tuple[Tuple[str, Tuple[str, ...]], ...] = (
    ("micro_batch_size", ("train_micro_batch_size_per_gpu",)),
    ("gas", ("gradient_accumulation_steps",)),
    ("global_batch_size", ("train_batch_size",)),
    ("zero_stage", ("zero_optimization", "stage")),
    ("fp16", ("fp16", "enabled")),
    ("bf16", ("bf16", "enabled")),
    ("clip_grad", ("gradient_clipping",)),
    ("loss_scale", ("fp16", "loss_scale")),
    ("initial_loss_scale", ("fp16", "initial_scale_power")),
    ("loss_scale_window", ("fp16", "loss_scale_window")),
    ("hysteresis", ("fp16", "hysteresis")),
    ("min_loss_scale", ("fp16", "min_loss_scale")),
    ("distributed_timeout_minutes", ("pipeline", "timeout_s")),
    ("pipeline_schedule", ("pipeline", "schedule")),
    ("virtual_pipe_stages", ("pipeline", "virtual_stages")),
    ("pipeline_timeline", ("pipeline", "timeline")),
    ("pipeline_timeline_batches", ("pipeline", "timeline_batches")),
)
FLAG = {name: "--" + name.replace("_", "-") for name, _ in SHARED}
# top-level keys of DeepSpeed's JSON (0.19): those above and the common others. An unknown key one or two letters
# from one of these is a typo or damage, which DeepSpeed would ignore silently: it is refused, naming both.
KNOWN_KEYS = sorted({path[0] for _, path in SHARED} | {
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer", "wall_clock_breakdown", "steps_per_print",
    "bfloat16", "amp", "prescale_gradients", "gradient_predivide_factor", "sparse_gradients", "optimizer",
    "scheduler", "activation_checkpointing", "flops_profiler", "tensorboard", "wandb", "csv_monitor", "comet",
    "communication_data_type", "seq_parallel_communication_data_type", "checkpoint", "data_types",
    "torch_autocast", "memory_breakdown", "dump_state", "elasticity", "aio", "compile", "dataloader_drop_last",
    "disable_allgather", "timers", "monitor_config"})
FORBIDDEN_SECTIONS = ("optimizer", "scheduler")
# the keys of DeepSpeed 0.19's `zero_optimization` (DeepSpeedZeroConfig's fields and aliases): DeepSpeed refuses any
# other key there (its pydantic model forbids extras), so this project does too (tests/config checks the list)
ZERO_KEYS = frozenset("""
allgather_bucket_size allgather_partitions allgather_sequential compute_grad_norm contiguous_gradients cpu_offload
cpu_offload_param cpu_offload_use_pin_memory elastic_checkpoint enable_sanity_checks gather_16bit_weights_on_model_save
ignore_unused_parameters leaf_module legacy_stage1 load_from_fp32_weights log_trace_cache_warnings max_live_parameters
max_reuse_distance memory_efficient_linear model_persistence_threshold module_granularity_threshold offload_optimizer
offload_param overlap_comm override_module_apply param_persistence_threshold parameter_alignment
pipeline_loading_checkpoint prefetch_bucket_size reduce_bucket_size reduce_scatter round_robin_gradients
save_muon_momentum_buffer_in_memory stage stage3_allgather_sequential stage3_gather_16bit_weights_on_model_save
stage3_gather_fp16_weights_on_model_save stage3_max_live_parameters stage3_max_reuse_distance
stage3_model_persistence_threshold stage3_module_granularity_threshold stage3_param_persistence_threshold
stage3_prefetch_bucket_size stage3_use_all_reduce_for_fetch_params sub_group_size use_all_reduce_for_fetch_params
use_multi_rank_bucket_allreduce zenflow zero_hpz_partition_size zero_quantized_gradients
zero_quantized_nontrainable_weights zero_quantized_weights""".split())


class ConfigConflictError(UserError):
    """The DeepSpeed JSON and the command line disagree, or the JSON cannot be used."""


def load_json(path: Optional[str]) -> Dict[str, Any]:
    """The DeepSpeed JSON config as a dict ({} without a path); a one-line error for a missing or bad file."""
    if path is None:
        return {}
    try:
        with open(path, "rb") as f:
            cfg = json.loads(f.read().decode("utf-8"))
    except OSError as err:
        raise ConfigConflictError(f"--deepspeed_config {path}: cannot read it ({err.strerror})") from None
    except json.JSONDecodeError as err:
        raise ConfigConflictError(f"--deepspeed_config {path}: not valid JSON ({err.msg} at line {err.lineno} "
                                  f"column {err.colno})") from None
    except UnicodeDecodeError as err:
        raise ConfigConflictError(f"--deepspeed_config {path}: not UTF-8 text (byte {err.start}); the file is "
                                  f"damaged") from None
    if not isinstance(cfg, dict):
        raise ConfigConflictError(f"--deepspeed_config {path}: expected a JSON object, got {type(cfg).__name__}")
    for key in cfg:
        near = difflib.get_close_matches(key, KNOWN_KEYS, n=1, cutoff=0.8) if key not in KNOWN_KEYS else []
        if near:
            raise ConfigConflictError(f"--deepspeed_config {path}: unknown key {key!r}, did you mean {near[0]!r}? "
                                      f"(DeepSpeed ignores keys it does not know; the file is mistyped or damaged)")
    _check_zero_section(cfg.get("zero_optimization", {}), path)
    if "bfloat16" in cfg:  # DeepSpeed's older spelling
        cfg.setdefault("bf16", cfg.pop("bfloat16"))
    for section in FORBIDDEN_SECTIONS:
        if section in cfg:
            raise ConfigConflictError(f"{path}: remove the '{section}' section; the optimizer and learning-rate "
                                      f"schedule are built from --lr, --min-lr, --lr-decay-style, --weight-decay, ...")
    return cfg


def _check_zero_section(zero: Any, path: str) -> None:
    """`zero_optimization` is an object of the keys DeepSpeed's ZeRO config has (ZERO_KEYS)."""
    if not isinstance(zero, dict):
        raise ConfigConflictError(f"--deepspeed_config {path}: zero_optimization is a JSON {type(zero).__name__}, "
                                  f"expected an object such as {{\"stage\": 1}}")
    for key in zero:
        if key not in ZERO_KEYS:
            near = difflib.get_close_matches(key, ZERO_KEYS, n=1, cutoff=0.8)
            hint = f", did you mean {near[0]!r}?" if near else ""
            raise ConfigConflictError(f"--deepspeed_config {path}: unknown key {key!r} in zero_optimization{hint} "
                                      f"(DeepSpeed refuses keys its ZeRO config does not have; the file is mistyped "
                                      f"or damaged)")


def _lookup(cfg: Dict[str, Any], path: Tuple[str, ...]) -> Any:
    node: Any = cfg
    for key in path:
        if not isinstance(node, dict) or key not in node:
            return None
        node = node[key]
    return node


def _json_to_arg(name: str, value: Any) -> Any:
    if value is None or value == "auto":
        return None
    if name == "loss_scale":
        return None if value == 0 else float(value)
    if name == "initial_loss_scale":
        return float(2 ** value)
    if name in ("fp16", "bf16"):
        return bool(value)
    if name == "distributed_timeout_minutes":
        return float(value) / 60
    if name == "pipeline_schedule":
        return str(value).lower()
    if name == "pipeline_timeline_batches" and isinstance(value, int):
        return [value]
    return value


def merge_json_into_args(args: argparse.Namespace, cfg: Dict[str, Any], path: str = "ds_config") -> Dict[str, str]:
    """Fill unset arguments from `cfg`; raise ConfigConflictError where both are set and differ. Returns
    {flag: 'json.path = value in PATH'} for the arguments the JSON filled (`from_json_note` names them)."""
    filled = {}
    for name, json_path in SHARED:
        from_json = _json_to_arg(name, _lookup(cfg, json_path))
        from_cli = getattr(args, name)
        if from_json is None:
            continue
        if from_cli is None:
            setattr(args, name, from_json)
            filled[FLAG[name]] = f"{'.'.join(json_path)} = {_lookup(cfg, json_path)} in {path}"
        elif from_cli != from_json:
            raise ConfigConflictError(
                f"{FLAG[name]} {from_cli} conflicts with {'.'.join(json_path)} = {_lookup(cfg, json_path)} "
                f"in {path}; remove one of them or make them agree")
    return filled


def from_json_note(message: str, filled: Dict[str, str]) -> str:
    """`message` (a resolution error) with where a flag it names took its value, when the JSON set it."""
    named = [where for flag, where in filled.items() if re.search(rf"{re.escape(flag)}(?![\w-])", message)]
    return message + (f" (set by {'; '.join(named)})" if named else "")


def initial_scale_power(initial_loss_scale: float) -> int:
    power = math.log2(initial_loss_scale)
    if initial_loss_scale <= 0 or power != int(power):
        raise UserError(f"--initial-loss-scale must be a power of two (DeepSpeed stores its exponent), "
                         f"got {initial_loss_scale}")
    return int(power)


def deepspeed_zero_stage(args: argparse.Namespace) -> int:
    """The ZeRO stage DeepSpeed runs: --zero-stage, except that stage 1 with one data-parallel rank has
    nothing to partition and runs as stage 0 (same numbers, no flat-buffer copies: 0.86 -> 0.97 of a plain
    PyTorch loop's tokens/s in bench/framework_overhead.py). fp16 keeps stage 1, see arg_resolution."""
    if args.zero_stage == 1 and args.data_parallel_size == 1 and not args.fp16:
        return 0
    return args.zero_stage


def build_ds_config(args: argparse.Namespace, cfg: Dict[str, Any]) -> Dict[str, Any]:
    """The dict DeepSpeed receives: `cfg` with every shared value replaced by the resolved argument."""
    out = copy.deepcopy(cfg)
    out["train_batch_size"] = args.global_batch_size
    out["train_micro_batch_size_per_gpu"] = args.micro_batch_size
    out["gradient_accumulation_steps"] = args.gas
    out["gradient_clipping"] = args.clip_grad
    out.setdefault("zero_optimization", {})["stage"] = deepspeed_zero_stage(args)
    out.setdefault("zero_allow_untested_optimizer", True)
    out.setdefault("steps_per_print", 2 ** 31 - 1)  # megatron.training.pretrain logs instead
    out.setdefault("wall_clock_breakdown", False)
    fp16 = out.setdefault("fp16", {})
    fp16["enabled"] = bool(args.fp16)
    if args.fp16:
        fp16.update(loss_scale=args.loss_scale or 0, initial_scale_power=initial_scale_power(args.initial_loss_scale),
                    loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
                    min_loss_scale=args.min_loss_scale)
    out.setdefault("bf16", {})["enabled"] = bool(args.bf16)
    pipeline = out.setdefault("pipeline", {})
    pipeline["timeout_s"] = 60 * args.distributed_timeout_minutes
    pipeline.update(schedule=args.pipeline_schedule, virtual_stages=args.virtual_pipe_stages)
    pipeline["check_finite"] = bool(args.check_for_nan_in_loss_and_grad and not args.fp16)  # fp16: loss scaler
    if getattr(args, "layout_invariant", False):
        pipeline["layout_invariant"] = True  # tds/pipe/fixed_order.py
    pipeline["recovery_script"] = False  # zero_to_fp32.py cannot read these checkpoints (convert_checkpoint.py can)
    if args.pipeline_timeline:
        pipeline.update(timeline=args.pipeline_timeline, timeline_batches=args.pipeline_timeline_batches)
    return out
