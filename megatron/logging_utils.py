"""Rank-filtered printing, the per-interval training log line, TensorBoard scalars.

The log line (one per --log-interval iterations, printed by the last rank, which holds the loss):

    iteration 20/200 | consumed samples 160 | lr 3.0e-04 | loss 5.1234 | grad norm 1.234 | loss scale 65536
    | skipped 0 | 123.4 ms/iter | 8291 tokens/s | 0.012 TFLOP/s/device | peak mem 1.23 GB

Averages are over the iterations of the interval (ms/iter, tokens/s, TFLOP/s, loss, grad norm). The line prints
the loss with 6 decimals; with MEGATRON_LOSS_RECORD set, the same rank also appends `iteration loss.hex()` to that
file (`record_loss`): the exact value, for tests that compare runs bit for bit.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, TextIO

import torch.distributed as dist


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _is_last_rank() -> bool:
    return not dist.is_initialized() or dist.get_rank() == dist.get_world_size() - 1


def print_line(message: str, stream: Optional[TextIO] = None) -> None:
    """`message` and its newline in one write, flushed. Ranks share one log (SLURM's --output, a launcher's
    stdout), and print() under PYTHONUNBUFFERED writes the newline separately, so another rank's line could
    land between the two."""
    stream = sys.stdout if stream is None else stream
    stream.write(message + "\n")
    stream.flush()


def print_rank_0(message: str) -> None:
    if _rank() == 0:
        print_line(message)


def print_rank_last(message: str) -> None:
    if _is_last_rank():
        print_line(message)


LOSS_RECORD = "MEGATRON_LOSS_RECORD"


def record_loss(iteration: int, loss: float) -> None:
    """Append `iteration loss.hex()` to the file MEGATRON_LOSS_RECORD names (last rank; nothing when unset)."""
    path = os.environ.get(LOSS_RECORD)
    if path and _is_last_rank():
        with open(path, "a") as f:
            f.write(f"{iteration} {float(loss).hex()}\n")


def recorded_losses(path: str) -> Dict[int, float]:
    """{iteration: loss} of a MEGATRON_LOSS_RECORD file; an iteration recorded twice (a restart) must have the
    same loss."""
    out: Dict[int, float] = {}
    with open(path) as f:
        for line in f:
            iteration, value = line.split()
            loss = float.fromhex(value)
            if out.setdefault(int(iteration), loss) != loss:
                raise ValueError(f"{path}: iteration {iteration} recorded twice, differently ({out[int(iteration)]!r}, "
                                 f"{loss!r})")
    return out


@dataclass
class IntervalStats:
    """What the training loop accumulates between two log lines."""
    losses: List[float] = field(default_factory=list)
    grad_norms: List[float] = field(default_factory=list)
    seconds: float = 0.0
    samples: int = 0

    def add(self, loss: float, grad_norm: Optional[float], seconds: float, samples: int) -> None:
        self.losses.append(loss)
        if grad_norm is not None:
            self.grad_norms.append(grad_norm)
        self.seconds += seconds
        self.samples += samples


def interval_metrics(stats: IntervalStats, tokens_per_sample: int, flops_per_sample: float,
                     world_size: int) -> Dict[str, float]:
    """Means over the interval: loss, grad norm, ms/iter, tokens/s, TFLOP/s per device (the global batch may
    change between iterations, so throughput counts the interval's samples)."""
    n = max(1, len(stats.losses))
    sec_per_iter = stats.seconds / n
    per_second = 1.0 / stats.seconds if stats.seconds > 0 else 0.0
    out = dict(loss=sum(stats.losses) / n, ms_per_iter=1e3 * sec_per_iter,
               tokens_per_s=stats.samples * tokens_per_sample * per_second,
               tflops_per_device=stats.samples * flops_per_sample * per_second / world_size / 1e12)
    if stats.grad_norms:
        out["grad_norm"] = sum(stats.grad_norms) / len(stats.grad_norms)
    return out


def format_log_line(iteration: int, train_iters: int, consumed: int, lr: float, metrics: Dict[str, float],
                    loss_scale: Optional[float], skipped: int, peak_bytes: int) -> str:
    parts = [f"iteration {iteration}/{train_iters}", f"consumed samples {consumed}", f"lr {lr:.4e}",
             f"loss {metrics['loss']:.6f}"]
    if "grad_norm" in metrics:
        parts.append(f"grad norm {metrics['grad_norm']:.4f}")
    if loss_scale is not None:
        parts.append(f"loss scale {loss_scale:g}")
    parts += [f"skipped {skipped}", f"{metrics['ms_per_iter']:.1f} ms/iter",
              f"{metrics['tokens_per_s']:.0f} tokens/s", f"{metrics['tflops_per_device']:.4f} TFLOP/s/device",
              f"peak mem {peak_bytes / 2 ** 30:.2f} GB"]
    return " | ".join(parts)


class TensorBoard:
    """Scalars under --tensorboard-dir, written by the last rank only; a no-op without a directory."""

    def __init__(self, log_dir: Optional[str]):
        self.writer = None
        if log_dir is None or not _is_last_rank():
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as err:  # torch.utils.tensorboard needs the tensorboard package
            raise RuntimeError(f"--tensorboard-dir {log_dir} needs the 'tensorboard' package "
                               f"(pip install tensorboard): {err}") from err
        self.writer = SummaryWriter(log_dir=log_dir)

    def scalars(self, values: Dict[str, float], step: int, prefix: str = "train/") -> None:
        if self.writer is None:
            return
        for name, value in values.items():
            self.writer.add_scalar(prefix + name, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()

