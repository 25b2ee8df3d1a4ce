"""The run's configuration as frozen records, one per section, built once from the resolved arguments.

    parse_args(argv)  -> resolved argparse.Namespace (megatron.config.resolution: every derived value, checks)
    settle(with_vocabulary(args, V), spec) -> RunConfig  (the tokenizer's vocabulary is the last value; frozen)

Each consumer receives the section it needs (torchtitan's JobConfig, nanoGPT's `model_args`):

    model       the model's own config (GPTConfig / T5Config: `spec.config(args)`)
    layout      (tp, pp, dp, ep), ZeRO stage, pipeline schedule, chunks per stage, partition, sequence parallelism
                                                                                            -> engine, checkpoints
    batch       micro-batch, gas, global batch, ramp-up, train length                       -> loop, loaders
    optimizer   AdamW and clipping;  lr: the LR schedule in its unit (iterations or samples)
    precision   fp16 / bf16;  data: datasets and micro-batches;  tokenizer: files and vocabulary sizes
    checkpoint  --save / --load and what to load;  logging: intervals, evaluation, TensorBoard
    exit        early stops: --exit-interval, signals, --exit-duration-in-mins, non-finite loss or gradients
    ds_config   the dict DeepSpeed receives (derived from the sections by megatron.config.ds_config)
    record      the full resolved command line, read-only: written to megatron_args.json for information

Section fields keep Megatron's argument names where one exists (`data.seq_length`, `batch.gas`), so code written
against the arguments reads a section unchanged. Nothing writes to a RunConfig after `settle`.
"""
from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass, fields
from types import MappingProxyType
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from megatron.config.batch_schedule import BatchSchedule


def _pick(cls, args: argparse.Namespace):
    """An instance of section `cls` from `args`: each field from the argument of the same name."""
    values = {}
    for f in fields(cls):
        value = getattr(args, f.name, None)
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


@dataclass(frozen=True)
class Layout:
    """Where each rank sits: tp x pp x dp = world_size; what DeepSpeed runs of ZeRO; the pipeline's shape."""
    world_size: int
    tp: int
    pp: int
    dp: int
    zero_stage: int              # --zero-stage as asked
    ds_zero_stage: int           # what DeepSpeed runs (stage 1 with one replica runs as 0, see ds_config)
    pipeline_schedule: str
    virtual_pipe_stages: int     # model chunks per pipeline stage (1 unless interleaved)
    partition_method: Union[None, str, Tuple[int, ...]]
    distributed_timeout_minutes: float
    sequence_parallel: bool = False  # split the norm/dropout/residual regions along the sequence over tp
    ep: int = 1                  # expert-parallel size (--expert-model-parallel-size), folded out of tp x dp


@dataclass(frozen=True)
class Batch:
    micro_batch_size: int
    gas: int
    global_batch_size: int
    data_parallel_size: int
    rampup_batch_size: Optional[Tuple[int, int, int]]
    train_iters: int
    train_samples: Optional[int]

    def schedule(self) -> BatchSchedule:
        return BatchSchedule.from_args(self)


@dataclass(frozen=True)
class Optimizer:
    lr: float
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float


@dataclass(frozen=True)
class LRSchedule:
    """Warm-up and decay lengths in `unit` ('iterations' or 'samples', Megatron's rule for --train-samples)."""
    unit: str
    lr: float
    min_lr: float
    warmup: int
    decay: int
    style: str


@dataclass(frozen=True)
class Precision:
    fp16: bool
    bf16: bool


@dataclass(frozen=True)
class Data:
    data_path: Tuple[str, ...]
    split: str
    seed: int
    seq_length: int
    encoder_seq_length: int
    decoder_seq_length: int
    mask_prob: float
    reset_position_ids: bool
    reset_attention_mask: bool
    eod_mask_loss: bool
    num_workers: int


@dataclass(frozen=True)
class Tokenizer:
    tokenizer_type: str
    vocab_file: Optional[str]
    merge_file: Optional[str]
    tokenizer_model: Optional[str]
    vocab_extra_ids: int
    vocab_size: Optional[int]          # None until the tokenizer is built (`settle`)
    padded_vocab_size: Optional[int]


@dataclass(frozen=True)
class Checkpoint:
    save: Optional[str]
    load: Optional[str]
    save_interval: Optional[int]
    async_save: bool
    ckpt_step: Optional[int]         # load this iteration instead of `latest`
    finetune: bool
    no_load_optim: bool
    no_load_rng: bool
    pretrained_checkpoint: Optional[str] = None  # weights to start from while `load` holds no checkpoint
    trust_checkpoint: bool = False   # read checkpoint pickles with weights_only=False (a trusted legacy file)


@dataclass(frozen=True)
class Logging:
    log_interval: int
    eval_interval: int
    eval_iters: int
    tensorboard_dir: Optional[str]
    deepspeed_verbose: bool
    log_memory: bool = False


@dataclass(frozen=True)
class Exit:
    """When a run stops early (saving first): an iteration multiple, a signal, a time limit, a non-finite step."""
    exit_interval: Optional[int]
    exit_signal_handler: bool
    exit_duration_in_mins: Optional[float]
    check_for_nan_in_loss_and_grad: bool
    max_skipped_steps: int                   # fp16: consecutive overflow skips before stopping (0 = never)
    check_replicas_interval: Optional[int] = None  # compare the data-parallel replicas' bits every N iterations
    check_replicas_at_save: bool = False     # and before every save


@dataclass(frozen=True)
class RunConfig:
    model_type: str
    seed: int
    model: Any                       # GPTConfig / T5Config (or a spec's own config)
    layout: Layout
    batch: Batch
    optimizer: Optimizer
    lr: LRSchedule
    precision: Precision
    data: Data
    tokenizer: Tokenizer
    checkpoint: Checkpoint
    logging: Logging
    exit: Exit
    ds_config: Mapping[str, Any]     # read-only; `deepspeed_dict()` gives DeepSpeed its own copy
    record: Mapping[str, Any]        # the resolved command line (JSON types), read-only

    def deepspeed_dict(self) -> Dict[str, Any]:
        return copy.deepcopy(dict(self.ds_config))


def layout_of(args: argparse.Namespace) -> Layout:
    return Layout(
        world_size=args.world_size, tp=args.tensor_model_parallel_size, pp=args.pipe_parallel_size,
        dp=args.data_parallel_size, zero_stage=args.zero_stage,
        ds_zero_stage=args.ds_config["zero_optimization"]["stage"], pipeline_schedule=args.pipeline_schedule,
        virtual_pipe_stages=args.virtual_pipe_stages or 1,
        partition_method=tuple(args.partition_method) if isinstance(args.partition_method, list)
        else args.partition_method, distributed_timeout_minutes=args.distributed_timeout_minutes,
        sequence_parallel=bool(getattr(args, "sequence_parallel", False)) and args.tensor_model_parallel_size > 1,
        ep=getattr(args, "expert_model_parallel_size", None) or 1)


def lr_schedule_of(args: argparse.Namespace) -> LRSchedule:
    samples = args.lr_schedule_unit == "samples"
    return LRSchedule(unit=args.lr_schedule_unit, lr=args.lr, min_lr=args.min_lr,
                      warmup=args.lr_warmup_samples if samples else args.lr_warmup_iters,
                      decay=args.lr_decay_samples if samples else args.lr_decay_iters, style=args.lr_decay_style)


def checkpoint_of(args: argparse.Namespace) -> Checkpoint:
    return Checkpoint(save=args.save, load=args.load, save_interval=args.save_interval,
                      async_save=bool(args.async_save),
                      ckpt_step=args.ckpt_step, finetune=bool(args.finetune), no_load_optim=bool(args.no_load_optim),
                      no_load_rng=bool(args.no_load_rng),
                      pretrained_checkpoint=getattr(args, "pretrained_checkpoint", None),
                      trust_checkpoint=bool(getattr(args, "trust_checkpoint", False)))


def json_record(args: argparse.Namespace) -> Dict[str, Any]:
    """The resolved arguments as JSON types (what megatron_args.json stores as the run record)."""
    return json.loads(json.dumps(vars(args), default=str))


def settle(args: argparse.Namespace, spec) -> RunConfig:
    """The RunConfig of resolved `args` whose vocabulary is settled (`resolution.with_vocabulary`); `spec` maps
    the arguments to the model's config (`spec.config(args)`)."""
    return RunConfig(
        model_type=args.model_type, seed=args.seed, model=spec.config(args), layout=layout_of(args),
        batch=_pick(Batch, args),
        optimizer=_pick(Optimizer, args), lr=lr_schedule_of(args), precision=_pick(Precision, args),
        data=_pick(Data, args), tokenizer=_pick(Tokenizer, args), checkpoint=checkpoint_of(args),
        logging=_pick(Logging, args), exit=_pick(Exit, args),
        ds_config=MappingProxyType(copy.deepcopy(args.ds_config)),
        record=MappingProxyType(json_record(args)))
