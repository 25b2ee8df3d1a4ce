"""The one place that derives settings from the ones a user gives, and validates them.

    dp                = world_size / (tp * pp)
    global_batch_size = micro_batch_size * gas * dp        (give either --global-batch-size or --gas)
    kv_channels       = hidden_size / num_attention_heads  (default)
    ffn_hidden_size   = 4 * hidden_size                    (default)
    lr_warmup_iters   = lr_warmup_fraction * lr_decay_iters (when the fraction is given)

Every error is one line naming the conflicting values.
"""
from __future__ import annotations

import argparse
import os
from typing import Optional

from megatron.ds_config import build_ds_config, initial_scale_power, load_json, merge_json_into_args

FP16_DEFAULTS = dict(initial_loss_scale=2.0 ** 32, min_loss_scale=1.0, loss_scale_window=1000, hysteresis=2)


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _resolve_parallel(args: argparse.Namespace, world_size: int) -> None:
    args.world_size = world_size
    args.pipe_parallel_size = max(1, args.pipe_parallel_size)
    tp, pp = args.tensor_model_parallel_size, args.pipe_parallel_size
    _need(tp >= 1, f"--tensor-model-parallel-size must be >= 1, got {tp}")
    _need(world_size % (tp * pp) == 0,
          f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
          f"--pipe-parallel-size {pp} = {tp * pp}")
    args.data_parallel_size = world_size // (tp * pp)
    method = args.partition_method
    if method is not None and method.replace(",", "").isdigit():
        bounds = [int(b) for b in method.split(",")]
        _need(len(bounds) == pp + 1, f"--partition-method {method} gives {len(bounds)} boundaries but "
              f"--pipe-parallel-size {pp} needs {pp + 1}")
        args.partition_method = bounds
    args.zero_stage = 1 if args.zero_stage is None else args.zero_stage
    _need(args.zero_stage in (0, 1), f"--zero-stage {args.zero_stage} is not supported: use 0 or 1 "
          "(ZeRO-2/3 partition gradients, which pipeline parallelism cannot accumulate across micro-batches)")


def _resolve_batch(args: argparse.Namespace) -> None:
    dp = args.data_parallel_size
    _need(args.micro_batch_size is not None, "--micro-batch-size is required (or train_micro_batch_size_per_gpu "
          "in the DeepSpeed config)")
    mb = args.micro_batch_size
    _need(mb >= 1, f"--micro-batch-size must be >= 1, got {mb}")
    if args.global_batch_size is None:
        args.gas = 1 if args.gas is None else args.gas
        _need(args.gas >= 1, f"--gas must be >= 1, got {args.gas}")
        args.global_batch_size = mb * args.gas * dp
        return
    gbs = args.global_batch_size
    _need(gbs % (mb * dp) == 0, f"--global-batch-size {gbs} is not divisible by --micro-batch-size {mb} x "
          f"data-parallel size {dp} = {mb * dp}")
    gas = gbs // (mb * dp)
    _need(args.gas is None or args.gas == gas,
          f"--global-batch-size {gbs} != --micro-batch-size {mb} x --gas {args.gas} x data-parallel size {dp} "
          f"= {mb * (args.gas or 0) * dp}")
    args.gas = gas


def _resolve_model(args: argparse.Namespace) -> None:
    for flag in ("num_layers", "hidden_size", "num_attention_heads"):
        _need(getattr(args, flag) is not None, f"--{flag.replace('_', '-')} is required")
    h, heads, tp = args.hidden_size, args.num_attention_heads, args.tensor_model_parallel_size
    _need(heads % tp == 0, f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}")
    if args.kv_channels is None:
        _need(h % heads == 0, f"--hidden-size {h} is not divisible by --num-attention-heads {heads}; "
              "give --kv-channels")
        args.kv_channels = h // heads
    args.ffn_hidden_size = 4 * h if args.ffn_hidden_size is None else args.ffn_hidden_size
    _need(args.ffn_hidden_size % tp == 0,
          f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by --tensor-model-parallel-size {tp}")
    enc = args.encoder_seq_length or args.seq_length
    _need(enc is not None, "--seq-length (or --encoder-seq-length) is required")
    args.seq_length = args.seq_length or enc
    args.encoder_seq_length = enc
    args.decoder_seq_length = args.decoder_seq_length or args.seq_length
    longest = max(args.seq_length, args.encoder_seq_length, args.decoder_seq_length)
    args.max_position_embeddings = args.max_position_embeddings or longest
    for flag in ("seq_length", "encoder_seq_length", "decoder_seq_length"):
        _need(getattr(args, flag) <= args.max_position_embeddings,
              f"--{flag.replace('_', '-')} {getattr(args, flag)} > --max-position-embeddings "
              f"{args.max_position_embeddings}")
    args.layernorm_epsilon = 1e-5 if args.layernorm_epsilon is None else args.layernorm_epsilon
    _need(args.checkpoint_num_layers >= 1, f"--checkpoint-num-layers must be >= 1, got {args.checkpoint_num_layers}")


def _resolve_precision(args: argparse.Namespace) -> None:
    args.fp16, args.bf16 = bool(args.fp16), bool(args.bf16)
    _need(not (args.fp16 and args.bf16), "--fp16 and --bf16 are both set (command line or DeepSpeed config); "
          "choose one")
    for key, value in FP16_DEFAULTS.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    initial_scale_power(args.initial_loss_scale)
    _need(not (args.fp16 and args.zero_stage == 0),
          "--fp16 with --zero-stage 0 is refused: DeepSpeed 0.19's FP16_UnfusedOptimizer unscales gradients that "
          "engine.backward never scaled (they come out divided by the loss scale); use --zero-stage 1")
    args.clip_grad = 1.0 if args.clip_grad is None else args.clip_grad
    _need(args.clip_grad >= 0, f"--clip-grad must be >= 0, got {args.clip_grad}")


def _resolve_schedule(args: argparse.Namespace) -> None:
    _need(args.train_iters is not None and args.train_iters >= 1, f"--train-iters must be >= 1, got "
          f"{args.train_iters}")
    args.lr_decay_iters = args.lr_decay_iters or args.train_iters
    _need(args.lr_warmup_iters is None or args.lr_warmup_fraction is None,
          f"--lr-warmup-iters {args.lr_warmup_iters} and --lr-warmup-fraction {args.lr_warmup_fraction} are both "
          "set; give one")
    if args.lr_warmup_fraction is not None:
        _need(0 <= args.lr_warmup_fraction <= 1, f"--lr-warmup-fraction must be in [0, 1], got "
              f"{args.lr_warmup_fraction}")
        args.lr_warmup_iters = int(args.lr_warmup_fraction * args.lr_decay_iters)
    args.lr_warmup_iters = args.lr_warmup_iters or 0
    _need(args.lr_warmup_iters <= args.lr_decay_iters, f"--lr-warmup-iters {args.lr_warmup_iters} > "
          f"--lr-decay-iters {args.lr_decay_iters}")
    _need(0 <= args.min_lr <= args.lr, f"--min-lr {args.min_lr} must be between 0 and --lr {args.lr}")
    _need(args.save_interval is None or args.save is not None,
          f"--save-interval {args.save_interval} needs --save DIR")
    _need(args.log_interval >= 1, f"--log-interval must be >= 1, got {args.log_interval}")
    _need(args.exit_interval is None or args.exit_interval >= 1,
          f"--exit-interval must be >= 1, got {args.exit_interval}")
    _need(args.eval_interval >= 1, f"--eval-interval must be >= 1, got {args.eval_interval}")


def _resolve_data(args: argparse.Namespace) -> None:
    paths = args.data_path or []
    if len(paths) > 1:
        _need(len(paths) % 2 == 0, f"--data-path with several datasets takes WEIGHT PREFIX pairs, got {len(paths)} "
              f"values: {paths}")
        for weight in paths[0::2]:
            try:
                float(weight)
            except ValueError:
                raise ValueError(f"--data-path weight {weight!r} is not a number (expected WEIGHT PREFIX pairs)")


def resolve_args(args: argparse.Namespace, world_size: Optional[int] = None) -> argparse.Namespace:
    """Merge the DeepSpeed JSON, derive every dependent value, validate; sets `args.ds_config`."""
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_json(args.deepspeed_config)
    merge_json_into_args(args, cfg, args.deepspeed_config or "ds_config")
    _resolve_parallel(args, world_size)
    _resolve_batch(args)
    _resolve_model(args)
    _resolve_precision(args)
    _resolve_schedule(args)
    _resolve_data(args)
    args.ds_config = build_ds_config(args, cfg)
    return args
