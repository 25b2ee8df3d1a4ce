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
import os
import time
from functools import partial
from typing import Callable, List, Optional, Sequence

import torch

import tds
from megatron import mpu
from megatron.config.resolution import with_vocabulary
from megatron.config.arguments import parse_args
from megatron.config.launcher_env import fill_launcher_env
from megatron.config.run_config import Batch, LRSchedule, RunConfig, settle
from megatron.training.batches import BatchIterator
from megatron.checkpointing import load_checkpoint, wait_for_saves
from megatron.data.samplers import build_pretraining_data_loader
from megatron.errors import UserError, one_line
from megatron.training.evaluation import evaluate_and_print
from megatron.training.initialize import initialize_megatron
from megatron.mpu import shutdown_distributed
from megatron.training.learning_rates import AnnealingLR
from megatron.logging_utils import TensorBoard, print_line, print_rank_0
from megatron.checkpointing.engine_files import ProjectCheckpointEngine
from megatron.model.specs import ModelSpec
from megatron.training.optimizer import build_optimizer
from megatron.config.preflight import build_tokenizer_from_args, check_inputs
from megatron.training.exit_conditions import ExitConditions, record_clean_end
from megatron.training.loop import TrainingStopped, TrainState, save_now, train


def lr_scheduler(optimizer: torch.optim.Optimizer, lr: LRSchedule) -> AnnealingLR:
    """The LR schedule in iterations (--train-iters) or in samples (--train-samples, Megatron's rule)."""
    return AnnealingLR(optimizer, lr.lr, lr.min_lr, lr.warmup, lr.decay, lr.style)


def setup_engine(cfg: RunConfig, spec: ModelSpec, state: mpu.ParallelState):
    """Pipe model over `state`'s groups, AdamW, LR schedule, wrapped by tds.initialize in the TDS PipelineEngine
    (whose groups are the model's grid: a view of `state`'s)."""
    try:
        model = spec.build_pipe(cfg, state)
        optimizer = build_optimizer(model, cfg.optimizer)
        engine, _, _, _ = tds.initialize(model=model, optimizer=optimizer, lr_scheduler=lr_scheduler(optimizer, cfg.lr),
                                         config=cfg.deepspeed_dict(), mpu=mpu,
                                         checkpoint_engine_wrap=ProjectCheckpointEngine)
    except ValueError as err:
        if isinstance(err, (UserError, tds.pipe.PipelineLayoutError)):
            raise
        raise UserError(f"tds/DeepSpeed refused the configuration: {one_line(err)} (from --partition-method, "
                        f"--fp16/--bf16 or --deepspeed_config {cfg.record['deepspeed_config']})") from err
    return engine


def data_loader(dataset, consumed: int, cfg: RunConfig, state: mpu.ParallelState) \
        -> Optional[torch.utils.data.DataLoader]:
    """This dp rank's loader resuming after `consumed` samples; None where no data is read (tp rank > 0)."""
    if dataset is None or state.tp_rank != 0:
        return None
    return build_pretraining_data_loader(dataset, consumed, cfg.batch.micro_batch_size, state.dp_rank, state.dims.dp,
                                         cfg.data.num_workers)


def split_sample_counts(batch: Batch, eval_iters: int) -> List[int]:
    """Samples each split must provide: --train-samples (or train_iters x gbs) for training, eval_iters x gbs
    for valid and test (every evaluation reads the same first samples)."""
    train = batch.train_samples if batch.train_samples is not None else batch.train_iters * batch.global_batch_size
    return [train] + [eval_iters * batch.global_batch_size] * 2


def settle_config(args: argparse.Namespace, spec: ModelSpec):
    """The tokenizer, then the frozen RunConfig with its vocabulary; returns (cfg, tokenizer)."""
    tokenizer = build_tokenizer_from_args(args)
    return settle(with_vocabulary(args, tokenizer.vocab_size), spec), tokenizer


def initialize_and_build(args: argparse.Namespace, spec: ModelSpec):
    """Tokenizer and RunConfig, distributed start-up, engine; returns (engine, tokenizer, cfg, the ParallelState)."""
    cfg, tokenizer = settle_config(args, spec)
    state = initialize_megatron(cfg)
    set_deepspeed_verbosity(cfg.logging.deepspeed_verbose)
    engine = setup_engine(cfg, spec, state)
    print_rank_0(layout_summary(cfg, engine) + "; " + predicted_peak(args, cfg.tokenizer.vocab_size))
    return engine, tokenizer, cfg, state


def set_deepspeed_verbosity(verbose: bool) -> None:
    """DeepSpeed's INFO log (its config dump, ZeRO and optimizer set-up) only with --deepspeed-verbose; the
    Pipe models get the same switch for DeepSpeed's constructor prints (see pretrain_*.py)."""
    from deepspeed.utils import logger
    logger.setLevel(logging.INFO if verbose else logging.WARNING)


def layout_summary(cfg: RunConfig, engine) -> str:
    """The one start-up line: layout, pipeline split, batch, ZeRO, vocabulary (DeepSpeed's own start-up
    prints only with --deepspeed-verbose)."""
    parts = getattr(engine.module, "parts", None)
    stages = "" if parts is None or len(parts) <= 2 else \
        "; stages hold layer specs " + " ".join(f"[{a}, {b})" for a, b in zip(parts, parts[1:]))
    b, layout = cfg.batch, cfg.layout
    batch = f"global batch {b.global_batch_size}"
    if b.rampup_batch_size is not None:
        start, _, samples = b.rampup_batch_size
        batch = f"global batch {start} -> {b.global_batch_size} over {samples} samples"
    dims = f"(tp, pp, dp) = ({layout.tp}, {layout.pp}, {layout.dp})" if layout.ep == 1 else \
        f"(tp, pp, ep, dp) = ({layout.tp}, {layout.pp}, {layout.ep}, {layout.dp})"
    return (f"{dims}{stages}; {batch} = micro "
            f"{b.micro_batch_size} x gas {b.gas} x dp {layout.dp}; ZeRO stage {layout.zero_stage} (DeepSpeed runs "
            f"stage {layout.ds_zero_stage}); vocabulary {cfg.tokenizer.vocab_size} tokens, padded to "
            f"{cfg.tokenizer.padded_vocab_size}")


def _attention() -> str:
    """The SDPA path the planner assumes: memory-efficient on GPU, the math path on CPU."""
    from tds import device as tds_device
    return "fused" if tds_device.is_cuda() else "math"


def predicted_peak(args: argparse.Namespace, vocab_size: int) -> str:
    """The planner's peak per rank for this layout (megatron.planning), for the start-up line."""
    from megatron.planning.report import short_prediction
    from megatron.planning.search import plan_for_args
    own, _ = plan_for_args(args, vocab_size, args.gpu_memory_gb or 80.0, attention=_attention())
    return short_prediction(own)


def dry_run(args: argparse.Namespace) -> None:
    """--dry-run: the prediction per stage without building the model (the tokenizer gives the vocabulary);
    a layout that does not fit raises the one-line UserError naming the part and the best alternative. With
    --gpu-memory-gb it plans for GPUs (fused attention) wherever it runs; without, for this machine's device (on
    CPU: memory only, no step time, `report.CPU_STEP`)."""
    from megatron.planning.report import dry_run_lines
    from megatron.planning.search import plan_for_args
    vocab = build_tokenizer_from_args(args).vocab_size
    # a GPU named by its memory is planned for as a GPU, also from a machine without one (a login node)
    attention = "fused" if args.gpu_memory_gb else _attention()
    own, best = plan_for_args(args, vocab, args.gpu_memory_gb or 80.0, attention=attention)
    lines = dry_run_lines(own, best, step_time=attention == "fused")  # no GPU step-time model for CPU processes
    if not own.fits:
        raise UserError(lines[0])
    print_line("\n".join(lines))


def already_complete(cfg: RunConfig, iteration: int) -> str:
    """The one line a run prints when --load already holds the last iteration."""
    b = cfg.batch
    length = (f"--train-samples {b.train_samples} ({b.train_iters} iterations)"
              if b.train_samples is not None else f"--train-iters {b.train_iters}")
    more = "--train-samples" if b.train_samples is not None else "--train-iters"
    return (f"training is already complete: the checkpoint in {cfg.checkpoint.load} is at iteration {iteration} of "
            f"{length}; "
            f"to train further raise {more} (TRAIN_ITERS=... with the example scripts), to start over use another "
            f"--save/--load directory (WORK_DIR=... with the example scripts)")


def pretrain(args: argparse.Namespace, spec: ModelSpec) -> TrainState:
    """Train to --train-iters (resuming from --load), save at the end, evaluate on the test split; stop
    early (saving first) on a signal or the time limit (`exit_conditions`)."""
    started = time.monotonic()
    engine, tokenizer, cfg, parallel = initialize_and_build(args, spec)
    exits = ExitConditions.of(cfg.exit, started)  # before the data loaders fork their workers
    try:
        state = _pretrain(engine, tokenizer, cfg, parallel, spec, exits)
    except BaseException:
        exits.close(failed=True)
        raise
    # the clean end is recorded while the handlers still turn a late copy of the signal (the script's forward, the
    # launcher's) into a flag: once they are restored, such a copy ends the process, and the record must be there
    record_clean_end(state.stopped or f"completed iteration {state.iteration} of {cfg.batch.train_iters}")
    exits.close()
    return state


def _pretrain(engine, tokenizer, cfg: RunConfig, parallel: mpu.ParallelState, spec: ModelSpec,
              exits: ExitConditions) -> TrainState:
    resume = cfg.checkpoint.load or cfg.checkpoint.pretrained_checkpoint
    iteration, consumed = load_checkpoint(engine, cfg) if resume else (0, 0)
    if iteration >= cfg.batch.train_iters:
        print_rank_0(already_complete(cfg, iteration))
        return TrainState(iteration, consumed, saved_iteration=iteration)
    data = cfg.data
    datasets = spec.datasets(data, tokenizer, split_sample_counts(cfg.batch, cfg.logging.eval_iters))
    if datasets[0] is None:
        raise UserError(f"--split {data.split} leaves no training documents in --data-path {' '.join(data.data_path)}")
    get_batch = partial(spec.get_batch, data=data, tokenizer=tokenizer, tp_group=parallel.tp_group)
    loaded = iteration if cfg.checkpoint.load else -1
    state = TrainState(iteration, consumed, saved_iteration=loaded, loaded_iteration=loaded)
    tb = TensorBoard(cfg.logging.tensorboard_dir)

    def eval_iter(split: int) -> Optional[Callable[[], BatchIterator]]:
        if datasets[split] is None:
            return None
        return lambda: BatchIterator(data_loader(datasets[split], 0, cfg, parallel), get_batch)

    train_iter = BatchIterator(data_loader(datasets[0], consumed, cfg, parallel), get_batch)
    try:
        train(engine, cfg, state, train_iter, eval_iter(1), tb, exits)
    except TrainingStopped:
        wait_for_saves()  # every rank stops together: a save still being written is completed and published
        raise
    if cfg.checkpoint.save and state.saved_iteration != state.iteration:
        save_now(engine, cfg, state)
    wait_for_saves()  # --async-save: every rank's files are written and the last checkpoint is published
    test_iter = eval_iter(2)
    if test_iter is not None and cfg.logging.eval_iters > 0 and state.iteration == cfg.batch.train_iters:
        evaluate_and_print(engine, cfg, test_iter(), "the end of training", tb, state.iteration, "test")
    tb.close()
    return state


def run(argv: Optional[Sequence[str]], spec: ModelSpec, defaults: dict) -> TrainState:
    """Entry-point main: the launcher's variables from SLURM or OpenMPI where no launcher set them (srun,
    mpirun), parse and resolve the arguments, check the input files exist, then `pretrain`."""
    fill_launcher_env(os.environ)
    args = parse_args(argv, defaults=defaults)
    check_inputs(args)
    if args.dry_run:
        dry_run(args)
        return TrainState(0, 0)
    state = pretrain(args, spec)
    shutdown_distributed()
    return state
