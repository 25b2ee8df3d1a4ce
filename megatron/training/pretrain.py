"""`pretrain()`: the driver shared by pretrain_gpt2.py and pretrain_t5.py.

    initialise (distributed, groups, seeds) -> tokenizer, padded vocabulary -> the Pipe model (one stage at
    pp = 1) + AdamW + LR schedule -> TDS engine -> --load -> datasets and loaders
    (the train sampler resumes after the consumed samples) -> train loop -> final test evaluation

An entry point names a `megatron.model.specs.ModelSpec`: how to build the Pipe model (with its loss), the
datasets and a micro-batch.

User mistakes are `megatron.errors.UserError`s (one line, exit 2 through the entry point's
`exit_on_user_error`): the arguments and input files (`megatron.config.preflight.check_inputs`, on every rank
before anything starts), tokenizer files that do not load, and what tds / DeepSpeed refuse in the
configuration when the engine is built (a ValueError there: --partition-method, the DeepSpeed JSON's
sections). tds cannot raise megatron's class (it never imports megatron), so the conversion happens here;
`tds.pipe.PipelineLayoutError` stays a bug: the layouts are declared by our Pipe models, not by the user.
"""
from __future__ import annotations

import argparse
import logging
from functools import partial
from typing import Callable, List, Optional, Sequence

import torch

import tds
from megatron import mpu
from megatron.config.resolution import with_vocabulary
from megatron.config.arguments import parse_args
from megatron.training.batches import BatchIterator
from megatron.checkpointing import load_checkpoint, save_checkpoint
from megatron.data.samplers import build_pretraining_data_loader
from megatron.errors import UserError, one_line
from megatron.training.evaluation import evaluate_and_print
from megatron.training.initialize import initialize_megatron
from megatron.mpu import shutdown_distributed
from megatron.training.learning_rates import AnnealingLR
from megatron.logging_utils import TensorBoard, print_rank_0
from megatron.model.specs import ModelSpec
from megatron.training.optimizer import build_optimizer
from megatron.config.preflight import check_inputs
from megatron.tokenizer import build_tokenizer
from megatron.training.loop import TrainState, train


def lr_scheduler(optimizer: torch.optim.Optimizer, args: argparse.Namespace) -> AnnealingLR:
    """The LR schedule in iterations (--train-iters) or in samples (--train-samples, Megatron's rule)."""
    if args.lr_schedule_unit == "samples":
        warmup, decay = args.lr_warmup_samples, args.lr_decay_samples
    else:
        warmup, decay = args.lr_warmup_iters, args.lr_decay_iters
    return AnnealingLR(optimizer, args.lr, args.min_lr, warmup, decay, args.lr_decay_style)


def setup_engine(args: argparse.Namespace, spec: ModelSpec, state: mpu.ParallelState):
    """Pipe model over `state`'s groups, AdamW, LR schedule, wrapped by tds.initialize in the TDS PipelineEngine
    (whose groups are the model's grid: a view of `state`'s)."""
    try:
        model = spec.build_pipe(args, state)
        optimizer = build_optimizer(model, args)
        engine, _, _, _ = tds.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler(optimizer, args),
                                         config=args.ds_config, mpu=mpu)
    except ValueError as err:
        if isinstance(err, (UserError, tds.pipe.PipelineLayoutError)):
            raise
        raise UserError(f"tds/DeepSpeed refused the configuration: {one_line(err)} (from --partition-method, "
                        f"--fp16/--bf16 or --deepspeed_config {args.deepspeed_config})") from err
    return engine


def data_loader(dataset, consumed: int, args: argparse.Namespace, state: mpu.ParallelState) \
        -> Optional[torch.utils.data.DataLoader]:
    """This dp rank's loader resuming after `consumed` samples; None where no data is read (tp rank > 0)."""
    if dataset is None or state.tp_rank != 0:
        return None
    return build_pretraining_data_loader(dataset, consumed, args.micro_batch_size, state.dp_rank, state.dims.dp,
                                         args.num_workers)


def split_sample_counts(args: argparse.Namespace) -> List[int]:
    """Samples each split must provide: --train-samples (or train_iters x gbs) for training, eval_iters x gbs
    for valid and test (every evaluation reads the same first samples)."""
    train = args.train_samples if args.train_samples is not None else args.train_iters * args.global_batch_size
    return [train] + [args.eval_iters * args.global_batch_size] * 2


def build_tokenizer_from_args(args: argparse.Namespace):
    """The tokenizer the arguments name; a file that does not load is a UserError naming it."""
    try:
        return build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model,
                               args.vocab_extra_ids)
    except (OSError, ValueError) as err:
        if isinstance(err, UserError):
            raise
        raise UserError(f"cannot build the {args.tokenizer_type}: {one_line(err)}") from err


def initialize_and_build(args: argparse.Namespace, spec: ModelSpec):
    """Distributed start-up, tokenizer, engine; returns (engine, tokenizer, args with the vocabulary settled,
    the ParallelState)."""
    state = initialize_megatron(args)
    tokenizer = build_tokenizer_from_args(args)
    args = with_vocabulary(args, tokenizer.vocab_size)
    set_deepspeed_verbosity(args.deepspeed_verbose)
    engine = setup_engine(args, spec, state)
    print_rank_0(layout_summary(args, engine, tokenizer.vocab_size))
    return engine, tokenizer, args, state


def set_deepspeed_verbosity(verbose: bool) -> None:
    """DeepSpeed's INFO log (its config dump, ZeRO and optimizer set-up) only with --deepspeed-verbose; the
    Pipe models get the same switch for DeepSpeed's constructor prints (see pretrain_*.py)."""
    from deepspeed.utils import logger
    logger.setLevel(logging.INFO if verbose else logging.WARNING)


def layout_summary(args: argparse.Namespace, engine, vocab_size: int) -> str:
    """The one start-up line: layout, pipeline split, batch, ZeRO, vocabulary (DeepSpeed's own start-up
    prints only with --deepspeed-verbose)."""
    parts = getattr(engine.module, "parts", None)
    stages = "" if parts is None or len(parts) <= 2 else \
        "; stages hold layer specs " + " ".join(f"[{a}, {b})" for a, b in zip(parts, parts[1:]))
    batch = f"global batch {args.global_batch_size}"
    if args.rampup_batch_size is not None:
        start, _, samples = args.rampup_batch_size
        batch = f"global batch {start} -> {args.global_batch_size} over {samples} samples"
    return (f"(tp, pp, dp) = ({args.tensor_model_parallel_size}, {args.pipe_parallel_size}, "
            f"{args.data_parallel_size}){stages}; {batch} = micro {args.micro_batch_size} x gas {args.gas} x dp "
            f"{args.data_parallel_size}; ZeRO stage {args.zero_stage} (DeepSpeed runs stage "
            f"{args.ds_config['zero_optimization']['stage']}); vocabulary {vocab_size} tokens, padded to "
            f"{args.padded_vocab_size}")


def already_complete(args: argparse.Namespace, iteration: int) -> str:
    """The one line a run prints when --load already holds the last iteration."""
    length = (f"--train-samples {args.train_samples} ({args.train_iters} iterations)"
              if args.train_samples is not None else f"--train-iters {args.train_iters}")
    more = "--train-samples" if args.train_samples is not None else "--train-iters"
    return (f"training is already complete: the checkpoint in {args.load} is at iteration {iteration} of {length}; "
            f"to train further raise {more} (TRAIN_ITERS=... with the example scripts), to start over use another "
            f"--save/--load directory (WORK_DIR=... with the example scripts)")


def pretrain(args: argparse.Namespace, spec: ModelSpec) -> TrainState:
    """Train to --train-iters (resuming from --load), save at the end, evaluate on the test split."""
    engine, tokenizer, args, parallel = initialize_and_build(args, spec)
    iteration, consumed = load_checkpoint(engine, args) if args.load else (0, 0)
    if iteration >= args.train_iters:
        print_rank_0(already_complete(args, iteration))
        return TrainState(iteration, consumed, saved_iteration=iteration)
    datasets = spec.datasets(args, tokenizer, split_sample_counts(args))
    if datasets[0] is None:
        raise UserError(f"--split {args.split} leaves no training documents in --data-path {' '.join(args.data_path)}")
    get_batch = partial(spec.get_batch, args=args, tokenizer=tokenizer, tp_group=parallel.tp_group)
    state = TrainState(iteration, consumed, saved_iteration=iteration if args.load else -1)
    tb = TensorBoard(args.tensorboard_dir)

    def eval_iter(split: int) -> Optional[Callable[[], BatchIterator]]:
        if datasets[split] is None:
            return None
        return lambda: BatchIterator(data_loader(datasets[split], 0, args, parallel), get_batch)

    train_iter = BatchIterator(data_loader(datasets[0], consumed, args, parallel), get_batch)
    train(engine, args, state, train_iter, eval_iter(1), tb)
    if args.save and state.saved_iteration != state.iteration:
        save_checkpoint(engine, args, state.iteration, state.consumed_train_samples)
    test_iter = eval_iter(2)
    if test_iter is not None and args.eval_iters > 0 and state.iteration == args.train_iters:
        evaluate_and_print(engine, args, test_iter(), "the end of training", tb, state.iteration,
                           "test")
    tb.close()
    return state


def run(argv: Optional[Sequence[str]], spec: ModelSpec, defaults: dict) -> TrainState:
    """Entry-point main: parse and resolve the arguments, check the input files exist, then `pretrain`."""
    args = parse_args(argv, defaults=defaults)
    check_inputs(args)
    state = pretrain(args, spec)
    shutdown_distributed()
    return state
