"""Layout-independent randomness: weight initialisation and dropout that do not depend on how the model is
split across processes, and dropout masks that need no saved state to resume.

Initialisation. Module number k of a model (embedding 0, transformer layers 1..L in order, final norms
and heads after) is built under `init_rng(seed, k)`: torch's CPU generator is set to seed + k for the
constructor and restored afterwards. The mpu layers draw their full master weights from that generator, so
a module holds the same values whichever pipeline stage builds it and whatever the tp size.

Dropout. Dropout site j of module k draws its mask, in training iteration i, on its c-th training-mode call
of that iteration (both counted from 0), from the device generator seeded with

    mix(seed, k, j, i, c)                   on activations replicated across tp ranks (hidden dropout)
    mix(seed + 2718 + tp_rank, k, j, i, c)  on activations split across tp ranks (attention probabilities,
                                            T5's inner feed-forward)

where mix is a fixed polynomial hash. Every site runs once per training micro-batch and the engines run a
stage's micro-batches in order, so c is the micro-batch number within the iteration: a mask is a pure
function of (seed, iteration, micro-batch, site). Hence
  - one process and any pipeline split draw the same masks (a stage does not consume a shared stream in
    the single-process order); ranks of a tp group agree on hidden-dropout masks and differ on split
    activations (Megatron's convention); data-parallel replicas draw the same masks for their m-th
    micro-batch;
  - nothing needs to be saved: the training loop announces each iteration with `start_iteration(model, i)`,
    so a run resumed at iteration i draws what the uninterrupted run drew. A model never told its iteration
    (used outside the loop) stays at i = 0 and c counts every training call since construction;
  - the device generator outside a site is untouched, so no other random stream depends on dropout.

Sequence parallelism. A hidden-dropout site that sees part r of t of the sequence (`sequence_part=(r, t)`,
dim 1 of (b, s, h)) draws the mask of the whole (b, s, h) tensor from the same seed and keeps rows
[r s/t, (r+1) s/t): its mask is the single process's mask of that slice, bit for bit (the draw depends only on
the seed, the shape and the dtype), so sequence parallelism changes no mask.

Activation checkpointing recomputes a segment during backward, which would advance the counters twice;
`replay_checkpoint` rewinds the segment's counters to their values at the first forward for the
recomputation and restores the live values afterwards (also when torch stops a recomputation early).
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from megatron.mpu.random import MODEL_PARALLEL_SEED_OFFSET
from tds import device as tds_device

_P = 1_000_003
_MASK = (1 << 63) - 1


def mix(*values: int) -> int:
    """Polynomial hash of non-negative ints into [0, 2^63): the per-call seed."""
    h = 0
    for v in values:
        h = (h * _P + int(v) + 1) & _MASK
    return h


@contextlib.contextmanager
def init_rng(seed: int, module_number: int) -> Iterator[None]:
    """Build a module under CPU generator seed + module_number, restoring the generator afterwards."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + module_number)
        yield


@contextlib.contextmanager
def _seeded_device_rng(seed: int) -> Iterator[None]:
    """Run the block on the device generator seeded with `seed`; the generator's state is restored after."""
    state = tds_device.get_rng_state()
    try:
        tds_device.manual_seed(seed)
        yield
    finally:
        tds_device.set_rng_state(state)


class SeededDropout(nn.Module):
    """Dropout site j of module k; see the module docstring for the seed rule.

    `forward(x)` is dropout; `with site.rng(): ...` runs any random op (e.g. the dropout inside
    scaled_dot_product_attention) on this site's seeded device generator and counts one call.
    """

    def __init__(self, p: float, seed: int, module_number: int, site: int, tp_split: bool = False,
                 tp_rank: int = 0, sequence_part: Tuple[int, int] = (0, 1)):
        """sequence_part (r, t): the input is part r of t of the sequence (sequence parallelism)."""
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.module_number, self.site, self.tp_split = p, module_number, site, tp_split
        self.sequence_part = sequence_part
        self.base_seed = seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank if tp_split else seed
        self.iteration = 0  # set by start_iteration
        self.calls = 0  # training-mode calls since then

    @property
    def active(self) -> bool:
        return self.training and self.p > 0

    def rng(self) -> contextlib.AbstractContextManager:
        seed = mix(self.base_seed, self.module_number, self.site, self.iteration, self.calls)
        self.calls += 1
        return _seeded_device_rng(seed)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return x
        part, parts = self.sequence_part
        if parts == 1:
            with self.rng():
                return F.dropout(x, self.p, training=True)
        n = x.size(1)  # (b, s/t, h): draw the whole (b, s, h) mask, keep this part
        with self.rng():
            keep = F.dropout(x.new_ones(x.size(0), n * parts, *x.shape[2:]), self.p, training=True)  # 0 or 1/(1-p)
        return x * keep.narrow(1, part * n, n).clone(memory_format=torch.contiguous_format)

    def extra_repr(self) -> str:
        sp = f", sequence_part={self.sequence_part}" if self.sequence_part[1] > 1 else ""
        return f"p={self.p}, module={self.module_number}, site={self.site}, tp_split={self.tp_split}{sp}"


def dropout_sites(module: nn.Module) -> list[SeededDropout]:
    return [m for m in module.modules() if isinstance(m, SeededDropout)]


def start_iteration(module: nn.Module, iteration: int) -> None:
    """Announce training iteration `iteration` (0 for the first) to every dropout site of `module`: the
    next training micro-batches are micro-batch 0, 1, ... of that iteration."""
    for site in dropout_sites(module):
        site.iteration, site.calls = iteration, 0


def replay_checkpoint(function: Callable[..., Any], sites: Sequence[SeededDropout], *args: Any) -> Any:
    """mpu.checkpoint(function, *args) whose recomputation sees the dropout counters of the first forward."""
    start = [s.calls for s in sites]
    ran = [False]

    def run(*inputs):
        live = [s.calls for s in sites]
        for s, c in zip(sites, start):
            s.calls = c
        try:
            return function(*inputs)
        finally:
            if ran[0]:
                for s, c in zip(sites, live):
                    s.calls = c
            ran[0] = True

    return mpu.checkpoint(run, *args)
