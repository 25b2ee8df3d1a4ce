"""One training iteration and the loop around it (logging, evaluation, checkpoints).

An iteration consumes one global batch = m micro-batches on every data-parallel replica:
engine.train_batch(data_iter) runs the TDS schedule over the m micro-batches, at every layout (pp = 1 is a
one-stage pipeline). The reported loss is the mean over micro-batches and data-parallel replicas.

m is --gas, or with --rampup-batch-size the ramp's value for the samples consumed so far
(`megatron.config.batch_schedule`): before each iteration `engine.set_train_batch_size` gets the iteration's global
batch (TDS and DeepSpeed's engine then run that many micro-batches) and, for an LR schedule in samples, the
scheduler advances by that batch at its step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, List, Optional

import tds
from megatron.config.batch_schedule import BatchSchedule
from megatron.config.run_config import RunConfig
from megatron.errors import UserError
from megatron.training.batches import Batch
from megatron.checkpointing import checkpoint_tag, save_checkpoint
from megatron.training.exit_conditions import ExitConditions
from megatron.training.evaluation import evaluate_and_print
from megatron.logging_utils import (IntervalStats, TensorBoard, format_log_line, interval_metrics, print_line,
                                    print_rank_0, print_rank_last, record_loss)
from megatron.model.rng import start_iteration
from megatron.model.moe import update_expert_bias
from megatron.training.moe_logging import format_moe, interval_moe_metrics, moe_layers
from megatron.model.specs import spec_for
from tds import device as tds_device


@dataclass
class TrainState:
    iteration: int
    consumed_train_samples: int
    losses: List[float] = field(default_factory=list)  # per iteration, from the first one of this run
    grad_norms: List[Optional[float]] = field(default_factory=list)  # before clipping, per iteration
    saved_iteration: int = -1     # the newest checkpoint of this run, or the one it resumed from
    loaded_iteration: int = -1
    skipped_in_a_row: int = 0     # fp16: consecutive steps skipped for overflow
    checked_iteration: int = -1   # the last iteration whose replica check passed
    checked_saved: int = -1       # the newest checkpoint saved up to that check (or the one the run resumed from)
    stopped: Optional[str] = None  # why the run stopped before --train-iters (a signal, the time limit)
    moe_metrics: List[dict] = field(default_factory=list)  # a MoE model's, per log line (`moe_logging`)


def set_iteration_batch(engine, lr_unit: str, schedule: BatchSchedule, consumed: int) -> int:
    """Size the engine (and an LR schedule in samples) for the next iteration's global batch; returns it."""
    batch = schedule.global_batch(consumed)
    if engine.train_batch_size() != batch:
        engine.set_train_batch_size(batch)
    if lr_unit == "samples":
        engine.lr_scheduler.increment = batch
    return batch


def _grad_norm(engine) -> Optional[float]:
    norm = engine.get_global_grad_norm()
    return None if norm is None else float(norm)


def _loss_scale(engine, fp16: bool) -> Optional[float]:
    return float(engine.optimizer.loss_scale) if fp16 else None


def _log_interval(engine, cfg: RunConfig, state: TrainState, stats: IntervalStats, lr: float, tb: TensorBoard) -> None:
    gbs = cfg.batch.global_batch_size
    spec = spec_for(cfg.model_type)
    flops = spec.flops(cfg.model, gbs, cfg.tokenizer.padded_vocab_size)
    metrics = interval_metrics(stats, spec.tokens_per_sample(cfg.data), flops / gbs, cfg.layout.world_size)
    scale = _loss_scale(engine, cfg.precision.fp16)
    moe = _moe_metrics(engine, cfg, stats)
    if moe:
        state.moe_metrics.append(moe)
    print_rank_last(format_log_line(state.iteration, cfg.batch.train_iters, state.consumed_train_samples, lr, metrics,
                                    scale, engine.skipped_steps, tds_device.max_memory_allocated()) + format_moe(moe))
    record_loss(state.iteration, metrics["loss"])
    extra = dict(lr=lr, consumed_samples=state.consumed_train_samples)
    if scale is not None:
        extra["loss_scale"] = scale
    tb.scalars({**metrics, **extra, **{f"moe/{name}": value for name, value in moe.items()}}, state.iteration)


def _moe_metrics(engine, cfg: RunConfig, stats: IntervalStats) -> dict:
    """A MoE model's balancing losses and loads over the interval (`moe_logging`); {} for a dense model."""
    moe = getattr(cfg.model, "moe", None)
    if moe is None:
        return {}
    return interval_moe_metrics(engine.module, cfg.model.num_layers, moe.num_experts,
                                stats.samples // cfg.batch.micro_batch_size, moe.per_layer_logging)


class TrainingStopped(UserError):
    """A step that cannot be taken (non-finite loss or gradients, fp16 skipping too long): one line, exit 2."""


def last_checkpoint(cfg: RunConfig, state: TrainState) -> str:
    """Where the newest checkpoint of this run (or the one it resumed from) is, for a stopping message."""
    if state.saved_iteration < 0:
        return "none (no checkpoint saved or loaded by this run)"
    folder = cfg.checkpoint.save if state.saved_iteration > state.loaded_iteration else cfg.checkpoint.load
    return f"{folder}/{checkpoint_tag(state.saved_iteration)} (iteration {state.saved_iteration})"


MEMORY_ITERATION = 2  # --log-memory: the first iteration with every optimizer buffer allocated


def log_memory(engine, cfg: RunConfig, step: Callable[[], object]):
    """Run `step` measured (megatron.training.memory_log); every rank prints its line with the prediction."""
    import argparse
    from megatron import mpu
    from megatron.planning.search import plan_for_args
    from megatron.training.memory_log import format_peak, measure_iteration
    result, peak = measure_iteration(engine.module, engine.optimizer, step)
    attention = "fused" if tds_device.is_cuda() else "math"
    state = mpu.get_parallel_state()
    own, _ = plan_for_args(argparse.Namespace(**cfg.record), cfg.tokenizer.vocab_size, 1e9, attention=attention)
    predicted = own.stages[state.pp_rank].peak
    where = f"iteration {MEMORY_ITERATION} rank {state.global_rank} (tp, pp, dp) = ({state.tp_rank}, {state.pp_rank}, " \
            f"{state.dp_rank})"
    print_line(format_peak(where, peak, int(predicted)))
    return result


def train_step(engine, cfg: RunConfig, state: TrainState, train_iter: Iterator[Batch]) -> float:
    """engine.train_batch for iteration state.iteration + 1; a non-finite value stops the run (TrainingStopped)."""
    try:
        if cfg.logging.log_memory and state.iteration + 1 == MEMORY_ITERATION:
            return float(log_memory(engine, cfg, lambda: engine.train_batch(data_iter=train_iter)))
        return float(engine.train_batch(data_iter=train_iter))
    except tds.pipe.NonFiniteError as err:
        raise TrainingStopped(f"iteration {state.iteration + 1}: {err.detail} (--check-for-nan-in-loss-and-grad); the "
                              f"last checkpoint is {last_checkpoint(cfg, state)}") from None


def _checked_checkpoint(cfg: RunConfig, state: TrainState) -> str:
    """Where to resume after a failed replica check: the newest checkpoint saved up to the last passing check."""
    if state.checked_iteration < 0:
        return f"no replica check passed in this run; the checkpoint it started from, unchecked, is " \
               f"{last_checkpoint(cfg, replace(state, saved_iteration=state.loaded_iteration))}"
    if state.checked_saved < 0:
        return f"the last passing check was at iteration {state.checked_iteration}, and no checkpoint was saved " \
               f"up to then"
    folder = cfg.checkpoint.save if state.checked_saved > state.loaded_iteration else cfg.checkpoint.load
    return f"the last passing check was at iteration {state.checked_iteration}; the newest checkpoint saved up to " \
           f"then is {folder}/{checkpoint_tag(state.checked_saved)}: load it with --ckpt-step {state.checked_saved}"


def check_replicas_now(engine, cfg: RunConfig, state: TrainState, why: str) -> None:
    """Compare the data-parallel replicas' bits at state.iteration (megatron.training.replicas); stop on a mismatch."""
    from megatron.training.replicas import check_replicas, optimizer_state_replicated, replicated_tensors
    replicated = optimizer_state_replicated(engine, cfg.layout.ds_zero_stage)
    spread = getattr(engine.grid, "experts", None)  # experts spread over ranks: their replicas are another group
    tensors = list(replicated_tensors(engine.module, engine.optimizer, replicated, False if spread else None))
    found = check_replicas(tensors, engine.grid.get_data_parallel_group())
    if spread and found is None:
        experts = list(replicated_tensors(engine.module, engine.optimizer, replicated, True))
        found = check_replicas(experts, spread["expert_data"])
    if found is not None:
        raise TrainingStopped(f"iteration {state.iteration}: {found} ({why}: silent corruption, e.g. a bad GPU or "
                              f"link); {_checked_checkpoint(cfg, state)}")
    state.checked_iteration, state.checked_saved = state.iteration, state.saved_iteration


def save_now(engine, cfg: RunConfig, state: TrainState) -> None:
    """Save at state.iteration; with --check-replicas-at-save only after the replicas passed a check there."""
    if cfg.exit.check_replicas_at_save and state.checked_iteration != state.iteration:
        check_replicas_now(engine, cfg, state, "--check-replicas-at-save")
    save_checkpoint(engine, cfg, state.iteration, state.consumed_train_samples)
    state.saved_iteration = state.iteration
    if state.checked_iteration == state.iteration:
        state.checked_saved = state.iteration


def check_skipped(engine, cfg: RunConfig, state: TrainState, skipped_before: int) -> None:
    """fp16: count consecutive steps the loss scaler skipped; stop after --max-skipped-steps of them."""
    state.skipped_in_a_row = state.skipped_in_a_row + 1 if engine.skipped_steps > skipped_before else 0
    limit = cfg.exit.max_skipped_steps
    if limit and state.skipped_in_a_row >= limit:
        raise TrainingStopped(f"iteration {state.iteration}: {state.skipped_in_a_row} consecutive steps skipped for "
                              f"fp16 overflow (loss scale {_loss_scale(engine, True)}; --max-skipped-steps {limit}); "
                              f"the last checkpoint is {last_checkpoint(cfg, state)}")


def save_and_exit(engine, cfg: RunConfig, state: TrainState, exits: ExitConditions, why: str) -> None:
    """Every rank: the run stops early at state.iteration (a signal, a time limit): save there with --save."""
    exits.ignore_further()
    where = "no --save: nothing saved"
    if cfg.checkpoint.save:
        if state.saved_iteration != state.iteration:
            save_now(engine, cfg, state)
        where = f"checkpoint {cfg.checkpoint.save}/{checkpoint_tag(state.iteration)}"
    state.stopped = f"exiting at iteration {state.iteration} of {cfg.batch.train_iters}: {why}; {where}"
    print_rank_0(state.stopped)


def train(engine, cfg: RunConfig, state: TrainState, train_iter: Iterator[Batch],
          make_valid_iter: Optional[Callable[[], Iterator[Batch]]], tb: TensorBoard,
          exits: Optional[ExitConditions] = None) -> TrainState:
    """Iterate from state.iteration + 1 to --train-iters (or the next multiple of --exit-interval, or until
    `exits` says stop); log, evaluate and save on their intervals."""
    stats, schedule, log, save = IntervalStats(), cfg.batch.schedule(), cfg.logging, cfg.checkpoint
    exits = exits or ExitConditions(False, None)
    replica = (engine.grid.get_data_parallel_rank(), engine.grid.get_data_parallel_world_size())
    engine.train()
    while state.iteration < cfg.batch.train_iters:
        batch = set_iteration_batch(engine, cfg.lr.unit, schedule, state.consumed_train_samples)
        lr = engine.lr_scheduler.get_lr()
        start = time.perf_counter()
        start_iteration(engine.module, state.iteration, replica)  # dropout masks follow (iteration, micro-batch)
        skipped_before = engine.skipped_steps
        exits.post()  # the stop agreement runs beside the iteration; read after it
        loss = train_step(engine, cfg, state, train_iter)
        moe = getattr(cfg.model, "moe", None)
        if moe is not None and moe.expert_bias:
            update_expert_bias(dict(moe_layers(engine.module)), cfg.model.num_layers, moe.num_experts)
        tds_device.synchronize()
        state.iteration += 1
        state.consumed_train_samples += batch
        state.losses.append(loss)
        state.grad_norms.append(_grad_norm(engine))
        stats.add(loss, state.grad_norms[-1], time.perf_counter() - start, batch)
        if cfg.precision.fp16:
            check_skipped(engine, cfg, state, skipped_before)
        if state.iteration % log.log_interval == 0:
            _log_interval(engine, cfg, state, stats, lr, tb)
            stats = IntervalStats()
        if make_valid_iter is not None and log.eval_iters > 0 and state.iteration % log.eval_interval == 0:
            evaluate_and_print(engine, cfg, make_valid_iter(), f"iteration {state.iteration}", tb,
                               state.iteration, "valid")
        exiting = cfg.exit.exit_interval is not None and state.iteration % cfg.exit.exit_interval == 0
        interval = cfg.exit.check_replicas_interval
        if interval and state.iteration % interval == 0:
            check_replicas_now(engine, cfg, state, f"--check-replicas-interval {interval}")
        if save.save and (exiting or (save.save_interval and state.iteration % save.save_interval == 0)):
            save_now(engine, cfg, state)
        if exiting:
            print_rank_last(f"exiting at iteration {state.iteration} (--exit-interval {cfg.exit.exit_interval})")
            break
        why = exits.reason()
        if why is not None:
            save_and_exit(engine, cfg, state, exits, why)
            break
    return state
