"""The one place that derives settings from the ones a user gives, and validates them.

    dp                = world_size / (tp * pp)
    global_batch_size = micro_batch_size * gas * dp        (give either --global-batch-size or --gas)
    kv_channels       = hidden_size / num_attention_heads  (default)
    ffn_hidden_size   = the model's default (`spec.default_ffn_size`: 4 * hidden_size; GPT's --swiglu: Megatron's rule)
    the model's own options (GPT's layer: rope, RMSNorm, SwiGLU, grouped-query attention, biases; T5's)
                      its spec's (`megatron.model.specs`: `spec.resolve`); another model's options are refused
    train_iters       = --train-iters, or what --train-samples allows (`megatron.config.batch_schedule`)
    LR schedule unit  = iterations, or samples with --train-samples (Megatron's rule): warm-up and decay
                        then come from --lr-warmup-samples / --lr-decay-samples (default train-samples)
    lr warm-up        = lr_warmup_fraction * decay length (when the fraction is given)
    pipeline schedule = --pipeline-schedule, else interleaved with --virtual-pipe-stages v > 1, else 1f1b;
                        v = --virtual-pipe-stages, or transformer layers / (pp x --num-layers-per-virtual-
                        pipeline-stage) (Megatron's flag); the interleaved schedule needs gas a multiple of pp

Every error is a one-line `megatron.errors.UserError` naming the conflicting values. Nothing here imports
torch or DeepSpeed (see `megatron.config.preflight`).
"""
from __future__ import annotations

import argparse
import os
import re
from typing import Optional

from megatron.config.batch_schedule import BatchSchedule
from megatron.config.ds_config import (build_ds_config, from_json_note, initial_scale_power, load_json,
                                       merge_json_into_args)
from megatron.config.moe_args import resolve_moe
from megatron.errors import UserError, flag_name as _flag, require as _need
from megatron.model.specs import SPECS, spec_for

FP16_DEFAULTS = dict(initial_loss_scale=2.0 ** 32, min_loss_scale=1.0, loss_scale_window=1000, hysteresis=2)

DISTRIBUTED_TIMEOUT_MINUTES = 10.0  # Megatron's default


def _resolve_parallel(args: argparse.Namespace, world_size: int) -> None:
    args.world_size = world_size
    args.pipe_parallel_size = max(1, args.pipe_parallel_size)
    tp, pp = args.tensor_model_parallel_size, args.pipe_parallel_size
    _need(tp >= 1, f"--tensor-model-parallel-size must be >= 1, got {tp}")
    _need(world_size % (tp * pp) == 0,
          f"world size {world_size} is not divisible by --tensor-model-parallel-size {tp} x "
          f"--pipe-parallel-size {pp} = {tp * pp}")
    args.data_parallel_size = world_size // (tp * pp)
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
    else:
        gbs = args.global_batch_size
        _need(gbs >= 1 and gbs % (mb * dp) == 0, f"--global-batch-size {gbs} is not divisible by "
              f"--micro-batch-size {mb} x data-parallel size {dp} = {mb * dp}")
        gas = gbs // (mb * dp)
        _need(args.gas is None or args.gas == gas,
              f"--global-batch-size {gbs} != --micro-batch-size {mb} x --gas {args.gas} x data-parallel size {dp} "
              f"= {mb * (args.gas or 0) * dp}")
        args.gas = gas


def _resolve_rampup(args: argparse.Namespace) -> None:
    if args.rampup_batch_size is None:
        return
    start, increment, samples = args.rampup_batch_size
    gbs, unit = args.global_batch_size, args.micro_batch_size * args.data_parallel_size
    where = f"--rampup-batch-size {start} {increment} {samples}"
    _need(increment >= 1 and samples >= 0, f"{where}: INCREMENT must be >= 1 and SAMPLES >= 0")
    _need(1 <= start < gbs, f"{where}: START must be between 1 and --global-batch-size {gbs} (exclusive)")
    _need((gbs - start) % increment == 0, f"{where}: --global-batch-size {gbs} - START = {gbs - start} is not "
          f"a multiple of INCREMENT {increment}")
    _need(start % unit == 0 and increment % unit == 0, f"{where}: START and INCREMENT must be multiples of "
          f"--micro-batch-size {args.micro_batch_size} x data-parallel size {args.data_parallel_size} = {unit}")


def _resolve_family(args: argparse.Namespace) -> None:
    """The model's own options by its spec; any other model's options are refused in one line."""
    spec = spec_for(args.model_type)
    for other in SPECS.values():
        if other is not spec:
            other.refuse_options(args, spec.entry_script)
    spec.resolve(args)


def _resolve_recompute(args: argparse.Namespace) -> None:
    """Megatron's --recompute-* flags; --checkpoint-activations / --checkpoint-num-layers are their aliases."""
    if args.checkpoint_activations:
        _need(args.recompute_granularity in (None, "full"), f"--checkpoint-activations means --recompute-granularity "
              f"full, but --recompute-granularity {args.recompute_granularity} was given; give one of them")
        args.recompute_granularity = "full"
    given = [n for n in (args.recompute_num_layers, args.checkpoint_num_layers) if n is not None]
    _need(len(set(given)) <= 1, f"--recompute-num-layers {args.recompute_num_layers} and --checkpoint-num-layers "
          f"{args.checkpoint_num_layers} disagree (the second is an alias of the first); give one")
    args.recompute_num_layers = args.checkpoint_num_layers = given[0] if given else 1
    _need(args.recompute_num_layers >= 1, f"--recompute-num-layers must be >= 1, got {args.recompute_num_layers}")
    _need(args.recompute_method is None or args.recompute_granularity == "full",
          f"--recompute-method {args.recompute_method} applies to --recompute-granularity full only")
    args.recompute_method = args.recompute_method or "uniform"
    args.checkpoint_activations = args.recompute_granularity == "full"


def _resolve_model(args: argparse.Namespace) -> None:
    for flag in ("num_layers", "hidden_size", "num_attention_heads"):
        _need(getattr(args, flag) is not None, f"{_flag(flag)} is required")
        _need(getattr(args, flag) >= 1, f"{_flag(flag)} must be >= 1, got {getattr(args, flag)}")
    h, heads, tp = args.hidden_size, args.num_attention_heads, args.tensor_model_parallel_size
    _need(heads % tp == 0, f"--num-attention-heads {heads} is not divisible by --tensor-model-parallel-size {tp}")
    if args.kv_channels is None:
        _need(h % heads == 0, f"--hidden-size {h} is not divisible by --num-attention-heads {heads}; "
              "give --kv-channels")
        args.kv_channels = h // heads
    spec = spec_for(args.model_type)
    args.ffn_hidden_size = spec.default_ffn_size(args) if args.ffn_hidden_size is None else args.ffn_hidden_size
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
              f"{_flag(flag)} {getattr(args, flag)} > --max-position-embeddings {args.max_position_embeddings}")
    if args.sequence_parallel and tp > 1:
        for flag in spec.sequence_flags:
            _need(getattr(args, flag) % tp == 0, f"--sequence-parallel: {_flag(flag)} {getattr(args, flag)} is not "
                  f"divisible by --tensor-model-parallel-size {tp}; use a multiple of {tp} or drop --sequence-parallel")
    args.layernorm_epsilon = 1e-5 if args.layernorm_epsilon is None else args.layernorm_epsilon
    _resolve_recompute(args)
    _resolve_family(args)


def resolve_model(args: argparse.Namespace) -> argparse.Namespace:
    """The model's part of the resolution alone (its derived sizes, the family's defaults and checks by its spec),
    for a tool that describes a model without a run (tools/plan_layout.py); `args` as the parser gives them."""
    _resolve_model(args)
    return args


PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved", "zb-h1")  # tds.pipe.schedule.SCHEDULES


def _virtual_stages(args: argparse.Namespace) -> Optional[int]:
    """--virtual-pipe-stages, or what Megatron's --num-layers-per-virtual-pipeline-stage implies."""
    v, per_chunk, pp = args.virtual_pipe_stages, args.num_layers_per_virtual_pipeline_stage, args.pipe_parallel_size
    if per_chunk is None:
        return v
    layers = spec_for(args.model_type).transformer_layers(args)
    _need(per_chunk >= 1 and layers % (pp * per_chunk) == 0, f"--num-layers-per-virtual-pipeline-stage {per_chunk} "
          f"x --pipe-parallel-size {pp} does not divide the {layers} transformer layers")
    _need(v is None or v == layers // (pp * per_chunk), f"--virtual-pipe-stages {v} conflicts with "
          f"--num-layers-per-virtual-pipeline-stage {per_chunk} ({layers} layers / ({pp} x {per_chunk}) = "
          f"{layers // (pp * per_chunk)} chunks per stage); give one of them")
    return layers // (pp * per_chunk)


def _resolve_pipeline(args: argparse.Namespace) -> None:
    """The pipeline schedule and its chunks per stage (see the module docstring)."""
    pp, v = args.pipe_parallel_size, _virtual_stages(args)
    schedule = args.pipeline_schedule or ("interleaved" if (v or 1) > 1 else "1f1b")
    _need(schedule in PIPELINE_SCHEDULES,
          f"pipeline schedule {schedule!r} is not one of {', '.join(PIPELINE_SCHEDULES)}")
    _need(schedule == "1f1b" or pp > 1, f"--pipeline-schedule {schedule} needs --pipe-parallel-size >= 2 (with one "
          f"stage there is no pipeline: the plain model runs on DeepSpeed's engine)")
    if schedule != "interleaved":
        _need(v in (None, 1), f"--virtual-pipe-stages {v} needs --pipeline-schedule interleaved, got {schedule}")
        args.pipeline_schedule, args.virtual_pipe_stages = schedule, 1
        return
    _need(v is not None and v >= 2, f"--pipeline-schedule interleaved needs --virtual-pipe-stages >= 2 (model chunks "
          f"per stage), got {v}")
    _need(args.gas % pp == 0, f"the interleaved schedule runs micro-batches in groups of --pipe-parallel-size {pp}: "
          f"--gas {args.gas} (global batch {args.global_batch_size} / (micro batch {args.micro_batch_size} x data-"
          f"parallel size {args.data_parallel_size})) must be a multiple of {pp}")
    layers = spec_for(args.model_type).transformer_layers(args)
    _need(layers >= pp * v, f"--pipe-parallel-size {pp} x --virtual-pipe-stages {v} = {pp * v} chunks, but the model "
          f"has {layers} transformer layers; every chunk needs one: lower --virtual-pipe-stages")
    if args.rampup_batch_size is not None:
        unit = args.micro_batch_size * args.data_parallel_size * pp
        _need(all(n % unit == 0 for n in args.rampup_batch_size[:2]), f"--rampup-batch-size "
              f"{' '.join(map(str, args.rampup_batch_size))} with the interleaved schedule: START and INCREMENT must "
              f"be multiples of micro batch x data-parallel size x pp = {unit} (gas a multiple of pp throughout)")
    args.pipeline_schedule, args.virtual_pipe_stages = schedule, v


def _resolve_timeline(args: argparse.Namespace) -> None:
    """--pipeline-timeline OUT.json records --pipeline-timeline-batches (default 3 4) of a pipeline run."""
    path, batches = args.pipeline_timeline, args.pipeline_timeline_batches
    if not path:
        _need(batches is None, "--pipeline-timeline-batches needs --pipeline-timeline OUT.json")
        return
    _need(args.pipe_parallel_size > 1, f"--pipeline-timeline {path} needs --pipe-parallel-size >= 2 (it records the "
          f"TDS pipeline engine)")
    folder = os.path.dirname(os.path.abspath(path))
    _need(os.path.isdir(folder), f"--pipeline-timeline {path}: folder {folder} does not exist; create it first")
    args.pipeline_timeline_batches = batches = list(batches or [3, 4])
    _need(all(1 <= b <= args.train_iters for b in batches), f"--pipeline-timeline-batches {' '.join(map(str, batches))}"
          f": iterations must be between 1 and --train-iters {args.train_iters}")


def _resolve_partition(args: argparse.Namespace) -> None:
    method, pp = args.partition_method, args.pipe_parallel_size
    if method is None or method in ("parameters", "uniform"):
        return
    if method.startswith("type:"):
        try:
            pattern = re.compile(method[5:], re.IGNORECASE)
        except re.error as err:
            raise UserError(f"--partition-method {method}: not a regular expression ({err})") from None
        names = spec_for(args.model_type).pipe_layer_classes
        _need(any(pattern.search(n) for n in names),
              f"--partition-method {method} matches none of the layer classes {', '.join(names)}")
        return
    _need(method.replace(",", "").isdigit(), f"--partition-method {method!r} is not type:REGEX, parameters, "
          f"uniform or comma-separated layer boundaries such as 0,5,11")
    bounds = [int(b) for b in method.split(",")]
    parts = pp * args.virtual_pipe_stages  # chunks of the pipeline
    _need(len(bounds) == parts + 1, f"--partition-method {method} gives {len(bounds)} boundaries but "
          f"--pipe-parallel-size {pp}" + (f" x --virtual-pipe-stages {args.virtual_pipe_stages}"
                                           if parts != pp else "") + f" needs {parts + 1}")
    last = spec_for(args.model_type).pipe_spec_count(args)
    rising = bounds[0] == 0 and all(a <= b for a, b in zip(bounds, bounds[1:]))
    _need(rising and last == bounds[-1], f"--partition-method {method}: boundaries must rise from 0 to "
          f"{last}, the number of layer specs of this model")
    args.partition_method = bounds


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


def _resolve_layout_invariant(args: argparse.Namespace) -> None:
    """--layout-invariant: what tds's pipeline.layout_invariant needs (tds/pipe/fixed_order.py), as one line."""
    if not args.layout_invariant:
        return
    dp = args.data_parallel_size
    _need(dp & (dp - 1) == 0, f"--layout-invariant sums over the data-parallel replicas in a fixed tree, which needs "
          f"their number to be a power of two; got data-parallel size {dp} (world {args.world_size} / "
          f"(tp {args.tensor_model_parallel_size} x pp {args.pipe_parallel_size}))")
    _need(args.pipeline_schedule != "zb-h1", "--layout-invariant needs each micro-batch's gradients complete after "
          "its backward, and --pipeline-schedule zb-h1 defers the weight gradients; use 1f1b, gpipe or interleaved")
    precision = "--fp16" if args.fp16 else "--bf16" if args.bf16 else None
    _need(precision is None, f"--layout-invariant runs in fp32 (the fp16 and bf16 optimizers sum and clip in their "
          f"own order); got {precision}")


def _resolve_length(args: argparse.Namespace) -> None:
    """train_iters from --train-iters or --train-samples (never both), and the matching LR schedule unit."""
    samples = args.train_samples is not None
    other = ["--train-iters", "--lr-decay-iters", "--lr-warmup-iters"] if samples else \
        ["--lr-decay-samples", "--lr-warmup-samples", "--rampup-batch-size"]
    values = [args.train_iters, args.lr_decay_iters, args.lr_warmup_iters] if samples else \
        [args.lr_decay_samples, args.lr_warmup_samples, args.rampup_batch_size]
    for flag, value in zip(other, values):
        shown = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        _need(value is None, f"{flag} {shown} cannot be combined with "
              + ("--train-samples: training is sample-based, give the LR schedule in samples"
                 if samples else "iteration-based training: give --train-samples instead of --train-iters"))
    if not samples:
        _need(args.train_iters is not None, "--train-iters (or --train-samples) is required")
        _need(args.train_iters >= 1, f"--train-iters must be >= 1, got {args.train_iters}")
        args.lr_schedule_unit = "iterations"
        args.lr_decay_iters = args.lr_decay_iters or args.train_iters
        args.lr_warmup_iters = _warmup(args, args.lr_warmup_iters, args.lr_decay_iters, "iters")
        return
    _resolve_rampup(args)
    schedule = BatchSchedule.from_args(args)
    args.train_iters = schedule.train_iters(args.train_samples)
    _need(args.train_iters >= 1, f"--train-samples {args.train_samples} is less than one global batch "
          f"({schedule.global_batch(0)})")
    args.lr_schedule_unit = "samples"
    args.lr_decay_samples = args.lr_decay_samples or args.train_samples
    args.lr_warmup_samples = _warmup(args, args.lr_warmup_samples, args.lr_decay_samples, "samples")


def _warmup(args: argparse.Namespace, warmup: Optional[int], decay: int, unit: str) -> int:
    _need(warmup is None or args.lr_warmup_fraction is None, f"--lr-warmup-{unit} {warmup} and "
          f"--lr-warmup-fraction {args.lr_warmup_fraction} are both set; give one")
    _need(decay >= 1, f"--lr-decay-{unit} must be >= 1, got {decay}")
    if args.lr_warmup_fraction is not None:
        _need(0 <= args.lr_warmup_fraction <= 1, f"--lr-warmup-fraction must be in [0, 1], got "
              f"{args.lr_warmup_fraction}")
        warmup = int(args.lr_warmup_fraction * decay)
    warmup = warmup or 0
    _need(0 <= warmup <= decay, f"--lr-warmup-{unit} {warmup} must be between 0 and --lr-decay-{unit} {decay}")
    return warmup


def _resolve_schedule(args: argparse.Namespace) -> None:
    _resolve_length(args)
    _need(0 <= args.min_lr <= args.lr, f"--min-lr {args.min_lr} must be between 0 and --lr {args.lr}")
    _need(args.save_interval is None or args.save is not None,
          f"--save-interval {args.save_interval} needs --save DIR")
    _need(args.log_interval >= 1, f"--log-interval must be >= 1, got {args.log_interval}")
    _need(args.exit_interval is None or args.exit_interval >= 1,
          f"--exit-interval must be >= 1, got {args.exit_interval}")
    _need(args.eval_interval >= 1, f"--eval-interval must be >= 1, got {args.eval_interval}")
    _need(args.exit_duration_in_mins is None or args.exit_duration_in_mins > 0,
          f"--exit-duration-in-mins must be > 0, got {args.exit_duration_in_mins}")
    _need(args.max_skipped_steps >= 0, f"--max-skipped-steps must be >= 0, got {args.max_skipped_steps}")
    _need(args.check_replicas_interval is None or args.check_replicas_interval >= 1,
          f"--check-replicas-interval must be >= 1, got {args.check_replicas_interval}")
    _need(not args.check_replicas_at_save or args.save is not None, "--check-replicas-at-save needs --save DIR")
    _need(not args.async_save or args.save is not None, "--async-save needs --save DIR")
    if args.distributed_timeout_minutes is None:
        args.distributed_timeout_minutes = DISTRIBUTED_TIMEOUT_MINUTES
    _need(args.distributed_timeout_minutes > 0,
          f"--distributed-timeout-minutes must be > 0, got {args.distributed_timeout_minutes}")
    _need(args.eval_iters >= 0, f"--eval-iters must be >= 0, got {args.eval_iters}")


def _resolve_split(split: str) -> None:
    """--split as megatron.data.gpt_dataset.parse_split reads it: up to 3 numbers, >= 0, positive sum."""
    parts = split.split("," if "," in split else "/")
    try:
        weights = [float(p) for p in parts]
    except ValueError:
        raise UserError(f"--split {split!r} must be numbers separated by ',' or '/', e.g. 949,50,1") from None
    _need(len(weights) <= 3 and min(weights) >= 0 and sum(weights) > 0,
          f"--split {split}: give up to 3 weights (train, valid, test) >= 0 with a positive sum")


def _resolve_data(args: argparse.Namespace) -> None:
    _resolve_split(args.split)
    for flag in ("hidden_dropout", "attention_dropout"):
        _need(0 <= getattr(args, flag) < 1, f"{_flag(flag)} must be in [0, 1), got {getattr(args, flag)}")
    _need(0 < args.mask_prob < 1, f"--mask-prob must be in (0, 1), got {args.mask_prob}")
    _need(args.num_workers >= 0, f"--num-workers must be >= 0, got {args.num_workers}")
    paths = args.data_path or []
    if len(paths) > 1:
        _need(len(paths) % 2 == 0, f"--data-path with several datasets takes WEIGHT PREFIX pairs, got {len(paths)} "
              f"values: {paths}")
        weights = []
        for weight in paths[0::2]:
            try:
                weights.append(float(weight))
            except ValueError:
                raise UserError(f"--data-path weight {weight!r} is not a number (expected WEIGHT PREFIX pairs)") \
                    from None
        _need(min(weights) >= 0 and sum(weights) > 0, f"--data-path weights {paths[0::2]} must be >= 0 with a "
              "positive sum")


def _resolve_checkpoint(args: argparse.Namespace) -> None:
    """--ckpt-step N names a tag folder iter_<N, 7 digits> of --load (files.checkpoint_tag) that exists;
    --pretrained-checkpoint DIR holds a checkpoint (its `latest` file)."""
    pretrained = getattr(args, "pretrained_checkpoint", None)
    if pretrained is not None:
        _need(os.path.isfile(os.path.join(pretrained, "latest")), f"--pretrained-checkpoint {pretrained} holds no "
              f"checkpoint (no 'latest' file); give the directory import-hf or a training run saved into")
        _need(args.ckpt_step is None and not args.finetune, "--pretrained-checkpoint starts from its weights when "
              "--load holds no checkpoint; it does not combine with --ckpt-step or --finetune")
    if args.ckpt_step is None:
        return
    _need(args.load is not None, f"--ckpt-step {args.ckpt_step} needs --load, the directory holding the checkpoint")
    tag = f"iter_{args.ckpt_step:07d}"
    if not os.path.isdir(os.path.join(args.load, tag)):
        present = sorted(n for n in os.listdir(args.load) if n.startswith("iter_")) if os.path.isdir(args.load) else []
        steps = ", ".join(str(int(n[5:])) for n in present if n[5:].isdigit()) or "none"
        raise UserError(f"--ckpt-step {args.ckpt_step}: {os.path.join(args.load, tag)} does not exist; the iterations "
                        f"saved in --load {args.load} are: {steps}")


def resolve_args(args: argparse.Namespace, world_size: Optional[int] = None) -> argparse.Namespace:
    """Merge the DeepSpeed JSON, derive every dependent value, validate; sets `args.ds_config`. The model is
    `args.model_type` (an entry script's default), GPT where none is given."""
    args.model_type = getattr(args, "model_type", None) or "gpt"
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    cfg = load_json(args.deepspeed_config)
    filled = merge_json_into_args(args, cfg, args.deepspeed_config or "ds_config")
    try:
        _resolve_parallel(args, world_size)
        _resolve_batch(args)
        _resolve_model(args)
        _resolve_pipeline(args)
        _resolve_partition(args)
        _resolve_precision(args)
        _resolve_layout_invariant(args)
        resolve_moe(args)
        _resolve_schedule(args)
        _resolve_timeline(args)
        _resolve_data(args)
        _resolve_checkpoint(args)
        args.ds_config = build_ds_config(args, cfg)
    except UserError as err:
        if not filled:
            raise
        raise type(err)(from_json_note(str(err), filled)) from None
    return args


def with_vocabulary(args: argparse.Namespace, vocab_size: int) -> argparse.Namespace:
    """The last resolution step, on the training ranks once the tokenizer is built: a copy of `args` with the
    tokenizer's vocabulary size and Megatron's padded size (`megatron.model.config.padded_vocab_size`)."""
    from megatron.model.config import padded_vocab_size  # imports torch, which resolution otherwise does not
    settled = argparse.Namespace(**vars(args))
    settled.vocab_size = vocab_size
    settled.padded_vocab_size = padded_vocab_size(vocab_size, args.make_vocab_size_divisible_by,
                                                  args.tensor_model_parallel_size)
    return settled
