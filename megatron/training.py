"""`pretrain()`: the driver shared by pretrain_gpt2.py and pretrain_t5.py.

    initialise (distributed, groups, seeds) -> tokenizer, padded vocabulary -> model (plain when pp == 1,
    the Pipe model otherwise) + AdamW + LR schedule -> TDS engine -> --load -> datasets and loaders
    (the train sampler resumes after the consumed samples) -> train loop -> final test evaluation

An entry point supplies a `ModelHooks`: how to build the model, the datasets, a micro-batch and the loss.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from functools import partial
from typing import Callable, List, Optional, Sequence

import torch

import tds
from megatron import mpu
from megatron.arguments import parse_args
from megatron.batches import BatchIterator
from megatron.checkpointing import load_checkpoint, save_checkpoint
from megatron.data.samplers import build_pretraining_data_loader
from megatron.evaluation import evaluate_and_print
from megatron.initialize import initialize_megatron
from megatron.learning_rates import AnnealingLR
from megatron.logging_utils import TensorBoard, print_rank_0
from megatron.model.config import padded_vocab_size
from megatron.optimizer import build_optimizer
from megatron.tokenizer import build_tokenizer
from megatron.train_loop import TrainState, train


@dataclass
class ModelHooks:
    """What an entry point provides.

    model_provider(args) -> nn.Module                 plain model when args.pipe_parallel_size == 1, else Pipe
    datasets_provider(args, tokenizer, [n_train, n_valid, n_test]) -> [train, valid, test] (None = empty)
    get_batch(raw, args, tokenizer) -> (inputs, labels)  raw: the loader's dict on tp rank 0, None elsewhere
    loss_fn(output, labels) -> scalar loss             used by the non-pipeline path
    """
    model_provider: Callable
    datasets_provider: Callable
    get_batch: Callable
    loss_fn: Callable


def setup_engine(args: argparse.Namespace, hooks: ModelHooks):
    """Model, AdamW, LR schedule, wrapped by tds.initialize (TDS PipelineEngine or DeepSpeedEngine)."""
    model = hooks.model_provider(args)
    optimizer = build_optimizer(model, args)
    scheduler = AnnealingLR(optimizer, args.lr, args.min_lr, args.lr_warmup_iters, args.lr_decay_iters,
                            args.lr_decay_style)
    engine, _, _, _ = tds.initialize(model=model, optimizer=optimizer, lr_scheduler=scheduler,
                                     config=args.ds_config, mpu=mpu)
    _keep_fp32_grad_norm(engine)
    return engine


def _keep_fp32_grad_norm(engine) -> None:
    """DeepSpeed's fp32 path without ZeRO (stage 0) clips gradients but drops their norm; keep it so the log
    and get_global_grad_norm() report it as they do under ZeRO-1."""
    from deepspeed.runtime.utils import clip_grad_norm_

    def clip_and_record():
        engine._global_grad_norm = float(clip_grad_norm_(parameters=engine.module.parameters(),
                                                         max_norm=engine.gradient_clipping(), mpu=engine.mpu))
    engine.clip_fp32_gradients = clip_and_record


def _reads_data() -> bool:
    return mpu.get_model_parallel_rank() == 0


def data_loader(dataset, consumed: int, args: argparse.Namespace) -> Optional[torch.utils.data.DataLoader]:
    """This dp rank's loader resuming after `consumed` samples; None where no data is read (tp rank > 0)."""
    if dataset is None or not _reads_data():
        return None
    return build_pretraining_data_loader(dataset, consumed, args.micro_batch_size, mpu.get_data_parallel_rank(),
                                         mpu.get_data_parallel_world_size(), args.num_workers)


def split_sample_counts(args: argparse.Namespace) -> List[int]:
    """Samples each split must provide: train_iters x gbs for training, eval_iters x gbs for valid and test
    (every evaluation reads the same first samples)."""
    return [args.train_iters * args.global_batch_size] + [args.eval_iters * args.global_batch_size] * 2


def initialize_and_build(args: argparse.Namespace, hooks: ModelHooks):
    """Distributed start-up, tokenizer (sets args.padded_vocab_size), engine; returns (engine, tokenizer)."""
    initialize_megatron(args)
    tokenizer = build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model,
                                args.vocab_extra_ids)
    args.vocab_size = tokenizer.vocab_size
    args.padded_vocab_size = padded_vocab_size(tokenizer.vocab_size, args.make_vocab_size_divisible_by,
                                               args.tensor_model_parallel_size)
    print_rank_0(f"vocabulary {tokenizer.vocab_size} tokens, padded to {args.padded_vocab_size}; "
                 f"(tp, pp, dp) = ({args.tensor_model_parallel_size}, {args.pipe_parallel_size}, "
                 f"{args.data_parallel_size}); global batch {args.global_batch_size} = micro {args.micro_batch_size}"
                 f" x gas {args.gas} x dp {args.data_parallel_size}; ZeRO stage {args.zero_stage}"
                 f" (DeepSpeed runs stage {args.ds_config['zero_optimization']['stage']})")
    return setup_engine(args, hooks), tokenizer


def pretrain(args: argparse.Namespace, hooks: ModelHooks) -> TrainState:
    """Train to --train-iters (resuming from --load), save at the end, evaluate on the test split."""
    engine, tokenizer = initialize_and_build(args, hooks)
    iteration, consumed = load_checkpoint(engine, args) if args.load else (0, 0)
    datasets = hooks.datasets_provider(args, tokenizer, split_sample_counts(args))
    if datasets[0] is None:
        raise ValueError(f"--split {args.split} leaves no training documents in --data-path {args.data_path}")
    get_batch = partial(hooks.get_batch, args=args, tokenizer=tokenizer)
    state = TrainState(iteration, consumed, saved_iteration=iteration if args.load else -1)
    tb = TensorBoard(args.tensorboard_dir)

    def eval_iter(split: int) -> Optional[Callable[[], BatchIterator]]:
        if datasets[split] is None:
            return None
        return lambda: BatchIterator(data_loader(datasets[split], 0, args), get_batch)

    if iteration < args.train_iters:
        train_iter = BatchIterator(data_loader(datasets[0], consumed, args), get_batch)
        train(engine, args, state, train_iter, hooks.loss_fn, eval_iter(1), tb)
    if args.save and state.saved_iteration != state.iteration:
        save_checkpoint(engine, args, state.iteration, state.consumed_train_samples)
    test_iter = eval_iter(2)
    if test_iter is not None and args.eval_iters > 0 and state.iteration == args.train_iters:
        evaluate_and_print(engine, args, test_iter(), hooks.loss_fn, "the end of training", tb, state.iteration,
                           "test")
    tb.close()
    return state


def run(argv: Optional[Sequence[str]], hooks: ModelHooks, defaults: dict) -> TrainState:
    """Entry-point main: parse and resolve the arguments, then `pretrain`."""
    return pretrain(parse_args(argv, defaults=defaults), hooks)
