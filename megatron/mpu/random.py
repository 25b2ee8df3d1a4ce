"""Megatron's RNG-tracker API (device-agnostic), and activation checkpointing that replays it.

The models in megatron/model do not draw from these streams: their dropout masks are a pure function of
(seed, iteration, micro-batch, site) (megatron/model/rng.py), which need no state. The tracker is kept for
code written against Megatron (`get_cuda_rng_tracker().fork()`, `model_parallel_cuda_manual_seed(seed)`);
its states are in every checkpoint (`rng_states` below), so such code resumes exactly too.

Two streams per process (Megatron):
    default stream         seed                    same on every tp rank: dropout on replicated activations
                                                   (outside the tensor-parallel region) agrees across ranks
    'model-parallel-rng'   seed + 2718 + tp_rank   differs per tp rank: dropout on split activations
                                                   (attention probabilities of this rank's heads)
The default stream is the device generator (`tds.device`: CUDA on GPU, torch's CPU generator on CPU); the
tracker keeps the other streams' states and swaps one in for the body of `fork(name)`.

Process seeding (Megatron, `set_random_seed`): python, numpy, torch's CPU generator and the device generator
of pipeline stage `pp_rank` start from seed + 100 * pp_rank, then the tracker's streams. `rng_states()` /
`set_rng_states()` capture and restore all of them for checkpoints. The models' weight initialisation and
dropout do not draw from these generators, so they are the same in every layout and need nothing saved.
"""
from __future__ import annotations

import contextlib
import random
from typing import Any, Callable, Dict, Iterator, Optional

import numpy as np
import torch
import torch.utils.checkpoint

from tds.device import get_rng_state, manual_seed, set_rng_state
from .parallel_state import get_tensor_model_parallel_rank

MODEL_PARALLEL_RNG = "model-parallel-rng"
MODEL_PARALLEL_SEED_OFFSET = 2718


class RNGStatesTracker:
    """Named device-generator states; `fork(name)` runs a block on one of them and saves where it ended."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.states_: Dict[str, torch.Tensor] = {}
        self.seeds_: set = set()

    def get_states(self) -> Dict[str, torch.Tensor]:
        """A copy of the name -> state dict (for checkpoints)."""
        return dict(self.states_)

    def set_states(self, states: Dict[str, torch.Tensor]) -> None:
        self.states_ = dict(states)

    def add(self, name: str, seed: int) -> None:
        """Create stream `name` seeded with `seed`, leaving the current device generator untouched."""
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} already used by another stream")
        if name in self.states_:
            raise ValueError(f"RNG stream {name!r} already exists")
        self.seeds_.add(seed)
        current = get_rng_state()
        manual_seed(seed)
        self.states_[name] = get_rng_state()
        set_rng_state(current)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Draw from stream `name` inside the block; the device generator is restored afterwards."""
        if name not in self.states_:
            raise KeyError(f"RNG stream {name!r} is not registered (known: {sorted(self.states_)}); "
                           f"call model_parallel_seed(seed) first")
        outside = get_rng_state()
        set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = get_rng_state()
            set_rng_state(outside)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    return _TRACKER


get_cuda_rng_tracker = get_rng_tracker


def model_parallel_seed(seed: int, tp_rank: Optional[int] = None) -> None:
    """Seed the default stream with `seed` and 'model-parallel-rng' with seed + 2718 + tp_rank.

    `tp_rank=None` reads the current tensor-model-parallel rank. Only the device generator is seeded
    (as Megatron); call torch.manual_seed too for CPU-side randomness such as weight initialisation.
    """
    tp_rank = get_tensor_model_parallel_rank() if tp_rank is None else tp_rank
    _TRACKER.reset()
    manual_seed(seed)
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + MODEL_PARALLEL_SEED_OFFSET + tp_rank)


model_parallel_cuda_manual_seed = model_parallel_seed


def _tracker_replay_contexts():
    """(forward ctx, recompute ctx): the recompute runs on the tracker states the forward started from."""
    saved: Dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def forward_ctx():
        saved.update(_TRACKER.get_states())
        yield

    @contextlib.contextmanager
    def recompute_ctx():
        after_forward = _TRACKER.get_states()
        _TRACKER.set_states(saved)
        try:
            yield
        finally:
            _TRACKER.set_states(after_forward)

    return forward_ctx(), recompute_ctx()


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Activation checkpointing: keep only `args`, recompute `function(*args)` during backward.

    The recompute sees the same CPU, device and tracker RNG states as the forward, so dropout masks and
    hence gradients equal the un-checkpointed ones exactly. Built on torch's non-reentrant checkpoint, so
    parameters get gradients even when no input requires grad.
    """
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False, preserve_rng_state=True,
                                             context_fn=_tracker_replay_contexts)


def set_random_seed(seed: int, pp_rank: int = 0) -> None:
    """Seed python, numpy, torch (CPU), the device generator and the tensor-parallel tracker."""
    seed = seed + 100 * pp_rank
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_seed(seed)


def rng_states() -> Dict[str, Any]:
    return dict(python=random.getstate(), numpy=np.random.get_state(), torch=torch.get_rng_state(),
                device=get_rng_state(), tracker=get_rng_tracker().get_states())


def set_rng_states(states: Dict[str, Any]) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["torch"])
    set_rng_state(states["device"])
    get_rng_tracker().set_states(states["tracker"])
