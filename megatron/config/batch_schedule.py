"""The global batch of every iteration: constant, or Megatron's ramp-up (`--rampup-batch-size START INCREMENT
SAMPLES`, `RampupBatchsizeNumMicroBatches`). A function of the samples consumed so far only, so a run
resumed from a checkpoint (which stores the consumed samples) continues the ramp exactly.

With B the final global batch (--global-batch-size), n = (B - START) / INCREMENT increments and c the samples
consumed before the iteration:

    c >  SAMPLES:  batch = B
    c <= SAMPLES:  batch = START + floor(c / (SAMPLES / n)) * INCREMENT

Every batch is a multiple of micro x dp (checked on START and INCREMENT), so an iteration is
batch / (micro x dp) micro-batches on each data-parallel replica; the sampler hands out global
micro-batches of micro x dp samples in order, so the data order does not depend on the ramp.

Iterations for --train-samples S (Megatron's `update_train_iters`): the ramp's iterations while c <= SAMPLES,
then floor((S - c) / B) at the full batch (a partial last batch is dropped); when S ends inside the ramp,
the iterations whose batches fit in S.
"""
from __future__ import annotations

from typing import Optional, Sequence


class BatchSchedule:
    """Global batch and micro-batches per iteration as a function of consumed samples."""

    def __init__(self, global_batch_size: int, micro_batch_size: int, data_parallel_size: int,
                 rampup: Optional[Sequence[int]] = None):
        self.global_batch_size = global_batch_size
        self.micro_times_dp = micro_batch_size * data_parallel_size
        self.rampup = None
        if rampup is not None:
            start, increment, samples = rampup
            self.rampup = (start, increment, samples / ((global_batch_size - start) // increment))
            self.rampup_samples = samples

    @classmethod
    def from_args(cls, args) -> "BatchSchedule":
        return cls(args.global_batch_size, args.micro_batch_size, args.data_parallel_size, args.rampup_batch_size)

    def global_batch(self, consumed_samples: int) -> int:
        if self.rampup is None or consumed_samples > self.rampup_samples:
            return self.global_batch_size
        start, increment, samples_per_increment = self.rampup
        return start + int(consumed_samples / samples_per_increment) * increment

    def micro_batches(self, consumed_samples: int) -> int:
        """Micro-batches of this iteration on each data-parallel replica (the engine's gas)."""
        return self.global_batch(consumed_samples) // self.micro_times_dp

    def train_iters(self, train_samples: int) -> int:
        """The most iterations whose batches add up to at most `train_samples` samples."""
        iterations, consumed = 0, 0
        while self.rampup is not None and consumed <= self.rampup_samples:
            batch = self.global_batch(consumed)
            if consumed + batch > train_samples:
                return iterations
            consumed, iterations = consumed + batch, iterations + 1
        return iterations + (train_samples - consumed) // self.global_batch_size
