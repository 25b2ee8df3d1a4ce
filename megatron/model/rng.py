"""Layout-independent randomness: weight initialisation and dropout that do not depend on how the model is
split across processes, and dropout masks that need no saved state to resume.

Initialisation. Module number k of a model (embedding 0, transformer layers 1..L in order, final norms
and heads after) is built under `init_rng(seed, k)`: torch's CPU generator is set to seed + k for the
constructor and restored afterwards. The mpu layers draw their full master weights from that generator, so
a module holds the same values whichever pipeline stage builds it and whatever the tp size.

Dropout. Dropout site j of module k draws its mask, in training iteration i, on its c-th training-mode call
of that iteration (both counted from 0), from the device generator seeded with

    mix(seed, k, j, i, c)          where mix is a fixed polynomial hash

and always for the whole tensor the single process sees. Every site runs once per training micro-batch and the
engines run a stage's micro-batches in order, so c is the micro-batch number within the iteration: a mask is a
pure function of (seed, iteration, micro-batch, site). With data parallelism (P replicas) replica r's m-th
micro-batch holds the samples of the single process's micro-batch m P + r (Megatron's sampler, `data.samplers`),
so its call counts as c = m P + r (`start_iteration(..., replica=(r, P))`). Hence
  - one process and any pipeline split draw the same masks (a stage does not consume a shared stream in
    the single-process order), and so do data-parallel replicas: each draws the masks of its samples;
  - nothing needs to be saved: the training loop announces each iteration with `start_iteration(model, i)`,
    so a run resumed at iteration i draws what the uninterrupted run drew. A model never told its iteration
    (used outside the loop) stays at i = 0 and c counts every training call since construction;
  - the device generator outside a site is untouched, so no other random stream depends on dropout.

Tensor and sequence parallelism. A site that sees part r of t of the tensor along one dim (`part=(dim, r, t)`:
a tp rank's heads of the attention probabilities (b, n, q, k) or its columns of T5's inner feed-forward
(b, s, f), or under sequence parallelism its rows of the sequence (b, s, h)) draws the mask of the whole tensor
from the same seed and keeps its part: the single process's mask of that slice, bit for bit (the draw depends
only on the seed, the shape and the dtype). So no tp size and no sequence split changes a mask, at the price of
drawing t times the random numbers. (Megatron instead gives split activations a stream per tp rank,
seed + 2718 + tp_rank, so its masks depend on tp; here that rule is left only to SDPA's fused kernels, which
draw their own masks: `rng(per_part=True)`, see `attention.attention_core`.)

Keyed masks (--keyed-dropout, `use_keyed_masks`). Instead, each element's keep bit is a pure function of

    key = mix(seed, k, j)    counter = (e // 4, global sample, i),    word e % 4 of the 4 it gives

through Philox4x32-10 (`philox.py`), e being the element's index within its sample's whole tensor: keep when the
word's top 24 bits, as a fraction, are below 1 - p.
The global sample is c b + n for sample n of a micro-batch of b (c as above), the single process's sample number in
the iteration whatever b is; the element index is its position in the sample's whole tensor (b excluded), so a part
draws exactly its own elements' numbers. Hence no micro-batch size, tp size, sequence split (or context-parallel
chunk) changes a mask, and a rank draws numbers for its part only. Slower than the generator on CPU
(docs/results.md).

Under --compile (`megatron.model.compile`) the draws run between the compiled graphs (`torch.compiler.disable`):
a graph cannot seed the device generator, and this way the masks are the eager ones, bit for bit.

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
from .philox import philox4x32, uniform24

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


Part = Tuple[int, int, int]  # (dim, r, t): the tensor a site sees is part r of t of the whole along dim
WHOLE: Part = (0, 0, 1)


def sequence_split(part: Tuple[int, int]) -> Part:
    """(r, t) of the sequence -> the Part along dim 1 of (b, s, h)."""
    return (1, *part)


class SeededDropout(nn.Module):
    """Dropout site j of module k; see the module docstring for the seed rule.

    `forward(x)` is dropout; `keep_mask(shape, ...)` draws the scaled mask of a part of that shape (and counts a
    call); `with site.rng(): ...` runs any random op on this site's seeded device generator and counts one call.
    """

    def __init__(self, p: float, seed: int, module_number: int, site: int, part: Part = WHOLE):
        """part (dim, r, t): the input is part r of t of the whole tensor along dim (module docstring)."""
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"dropout probability must be in [0, 1), got {p}")
        self.p, self.seed, self.module_number, self.site, self.part = p, seed, module_number, site, part
        self.iteration = 0  # set by start_iteration
        self.calls = 0  # training-mode calls since then
        self.replica = (0, 1)  # (dp rank, dp size), set by start_iteration
        self.keyed = False  # masks keyed by sample and position (`use_keyed_masks`)
        self.drawn = 0  # random numbers drawn by keyed masks (counted for the tests)

    @property
    def active(self) -> bool:
        return self.training and self.p > 0

    def rng(self, per_part: bool = False) -> contextlib.AbstractContextManager:
        """The site's generator for this call; per_part: a stream of this part's own (Megatron's seed + 2718 + r),
        for a kernel that draws only its part's mask itself."""
        base = self.seed + (MODEL_PARALLEL_SEED_OFFSET + self.part[1] if per_part else 0)
        return _seeded_device_rng(mix(base, self.module_number, self.site, self.iteration, self._micro_batch()))

    def _micro_batch(self) -> int:
        """This call's single-process micro-batch number c (module docstring); counts the call."""
        dp_rank, dp_size = self.replica
        self.calls += 1
        return (self.calls - 1) * dp_size + dp_rank

    @torch.compiler.disable  # --compile: int64 arithmetic that wraps, kept out of generated code
    def keyed_mask(self, shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
        """This part's mask, 0 or 1/(1-p), of `shape` (batch first), keyed by sample and position (module
        docstring): Philox numbers for this part's elements only."""
        dim, r, t = self.part
        dim %= len(shape)
        whole = list(shape)
        whole[dim] *= t
        first = [r * shape[d] if d == dim else 0 for d in range(len(shape))]
        sample = self._micro_batch() * whole[0] + first[0] + torch.arange(shape[0], dtype=torch.int64, device=device)
        key = mix(self.seed, self.module_number, self.site)
        word = _element_words(shape, whole, first, sample, self.iteration, key, device)
        self.drawn += word.numel()
        return (uniform24(word) < 1.0 - self.p).to(dtype).div_(1.0 - self.p)

    @torch.compiler.disable  # --compile: a mask draw sets the device generator's state, which no graph can
    def keep_mask(self, shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
        """This part's mask, 0 or 1/(1-p), of `shape`: the whole tensor's, drawn from this call's seed, narrowed.
        Drawn as dropout draws its noise on CPU (bernoulli_(1-p), then div_(1-p)), in place: one whole-sized
        tensor at a time, not three (the ones, the noise, their product). Keyed masks: `keyed_mask`."""
        if self.keyed:
            return self.keyed_mask(shape, dtype, device)
        dim, r, t = self.part
        whole = list(shape)
        whole[dim] *= t
        with self.rng():
            keep = torch.empty(whole, dtype=dtype, device=device).bernoulli_(1.0 - self.p).div_(1.0 - self.p)
        if t == 1:
            return keep
        return keep.narrow(dim, r * shape[dim], shape[dim]).clone(memory_format=torch.contiguous_format)  # own storage

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.active:
            return x
        if self.part[2] == 1 and not self.keyed:
            return self._dropout(x)
        return x * self.keep_mask(x.shape, x.dtype, x.device)

    @torch.compiler.disable  # --compile: runs between the compiled graphs (see keep_mask)
    def _dropout(self, x: torch.Tensor) -> torch.Tensor:
        with self.rng():
            return F.dropout(x, self.p, training=True)

    def extra_repr(self) -> str:
        part = f", part={self.part}" if self.part[2] > 1 else ""
        return f"p={self.p}, module={self.module_number}, site={self.site}{part}"


def _element_words(shape: Sequence[int], whole: Sequence[int], first: Sequence[int], sample: torch.Tensor,
                   iteration: int, key: int, device) -> torch.Tensor:
    """Each element's 32-bit word: word e % 4 of Philox4x32-10 at counter (e // 4 as two words, global sample,
    iteration) under `key`, e the element's index within its sample's whole tensor (sizes `whole`, batch first; this
    part starts at `first`). Where the last dim's whole, part and start are multiples of 4, one Philox call serves 4
    consecutive elements; elsewhere each element selects its word from a call of its own (the same numbers)."""
    last = len(shape) - 1
    step = 4 if last > 0 and whole[last] % 4 == 0 and shape[last] % 4 == 0 and first[last] % 4 == 0 else 1
    index = torch.zeros((), dtype=torch.int64, device=device)  # the element's, or its group of 4's first, index
    stride = 1
    for d in range(last, 0, -1):
        along = torch.arange(first[d], first[d] + shape[d], step if d == last else 1, dtype=torch.int64, device=device)
        index = index + (along * stride).view([-1 if e == d else 1 for e in range(len(shape))])
        stride *= whole[d]
    group = index >> 2
    words = philox4x32((group & 0xFFFFFFFF, group >> 32, sample.view([-1] + [1] * last), iteration & 0xFFFFFFFF),
                       (key & 0xFFFFFFFF, (key >> 32) & 0xFFFFFFFF))
    words = torch.stack(torch.broadcast_tensors(*words), dim=-1)
    if step == 4:
        return words.reshape(shape)
    return words.gather(-1, (index & 3).expand(words.shape[:-1]).unsqueeze(-1)).squeeze(-1).expand(shape)


def dropout_sites(module: nn.Module) -> list[SeededDropout]:
    return [m for m in module.modules() if isinstance(m, SeededDropout)]


def start_iteration(module: nn.Module, iteration: int, replica: Tuple[int, int] = (0, 1)) -> None:
    """Announce training iteration `iteration` (0 for the first) to every dropout site of `module`: the
    next training micro-batches are micro-batch 0, 1, ... of that iteration on data-parallel replica
    `replica` = (dp rank, dp size), i.e. the single process's micro-batches r, P + r, 2P + r, ..."""
    for site in dropout_sites(module):
        site.iteration, site.calls, site.replica = iteration, 0, replica


def use_keyed_masks(module: nn.Module) -> None:
    """Every dropout site of `module` draws keyed masks from now on (--keyed-dropout; module docstring)."""
    for site in dropout_sites(module):
        site.keyed = True


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
