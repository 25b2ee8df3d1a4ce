"""Validation / test loss: --eval-iters global batches (the full --global-batch-size), forward only, dropout off.

Every evaluation reads the same first eval_iters x global_batch samples of its split (the iterator is
rebuilt each time), so successive validation losses are comparable and a resumed run evaluates exactly as
an uninterrupted one. Perplexity = exp(mean loss), capped at exp(20) for printing.
"""
from __future__ import annotations

import argparse
import math
from typing import Callable, Iterator

import torch

from megatron.batches import forward_micro_batches
from megatron.logging_utils import TensorBoard, print_rank_last


def evaluate(engine, args: argparse.Namespace, data_iter: Iterator, loss_fn: Callable) -> float:
    """Mean loss over eval_iters x gas micro-batches and the data-parallel replicas."""
    losses = []
    if args.pipe_parallel_size > 1:
        for _ in range(args.eval_iters):  # full global batches, also while the training batch ramps up
            losses.append(float(engine.eval_batch(data_iter, num_micro_batches=args.gas)))
        return sum(losses) / len(losses)
    engine.eval()
    with torch.no_grad():
        for _ in range(args.eval_iters):
            losses.append(forward_micro_batches(engine, data_iter, loss_fn, args.gas, train=False))
    engine.train()
    return sum(losses) / len(losses)


def evaluate_and_print(engine, args: argparse.Namespace, data_iter: Iterator, loss_fn: Callable, where: str,
                       tb: TensorBoard, step: int, split: str) -> float:
    loss = evaluate(engine, args, data_iter, loss_fn)
    ppl = math.exp(min(20.0, loss))
    print_rank_last(f"{split} loss at {where} | lm loss {loss:.6f} | lm loss PPL {ppl:.3f}")
    tb.scalars(dict(loss=loss, ppl=ppl), step, prefix=f"{split}/")
    return loss
