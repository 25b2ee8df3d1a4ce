"""Validation / test loss: --eval-iters global batches (the full --global-batch-size), forward only, dropout off.

Every evaluation reads the same first eval_iters x global_batch samples of its split (the iterator is
rebuilt each time), so successive validation losses are comparable and a resumed run evaluates exactly as
an uninterrupted one. Perplexity = exp(mean loss), capped at exp(20) for printing.
"""
from __future__ import annotations

import math
from typing import Iterator

from megatron.logging_utils import TensorBoard, print_rank_last


def evaluate(engine, cfg, data_iter: Iterator) -> float:
    """Mean loss over eval_iters x gas micro-batches and the data-parallel replicas (`cfg`: a RunConfig)."""
    # full global batches, also while the training batch ramps up
    losses = [float(engine.eval_batch(data_iter, num_micro_batches=cfg.batch.gas))
              for _ in range(cfg.logging.eval_iters)]
    return sum(losses) / len(losses)


def evaluate_and_print(engine, cfg, data_iter: Iterator, where: str, tb: TensorBoard, step: int, split: str) -> float:
    loss = evaluate(engine, cfg, data_iter)
    ppl = math.exp(min(20.0, loss))
    print_rank_last(f"{split} loss at {where} | lm loss {loss:.6f} | lm loss PPL {ppl:.3f}")
    tb.scalars(dict(loss=loss, ppl=ppl), step, prefix=f"{split}/")
    return loss
