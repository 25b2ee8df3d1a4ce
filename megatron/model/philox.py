"""Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC 2011) in int64 tensor ops, on
any device: a counter-based generator, so any element's number is computed from its counter alone, in any order and
for any part of a tensor.

Each 32-bit word is held in an int64. A round's 32 x 32-bit products are computed in int64, where they wrap modulo
2^64 as two's complement: the low 32 bits are the product's, and the high 32 bits are (product >> 32) & 0xffffffff.
The known-answer vectors of Random123 are tests/model/test_keyed_dropout.py's.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import torch

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # round multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # key schedule (Weyl) increments
_LOW = 0xFFFFFFFF
ROUNDS = 10


def _mul(a: torch.Tensor, m: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit words of a * m, a's words in int64."""
    product = a * m  # wraps modulo 2^64
    return (product >> 32) & _LOW, product & _LOW


def philox4x32(counter: Sequence[torch.Tensor], key: Tuple[int, int], rounds: int = ROUNDS) -> list[torch.Tensor]:
    """The 4 output words (int64 tensors holding uint32 values) of Philox4x32-`rounds` at `counter` (4 broadcastable
    int64 tensors or ints of uint32 values) under `key` (2 uint32 ints)."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0, k1 = (k0 + _W0) & _LOW, (k1 + _W1) & _LOW
        hi0, lo0 = _mul(c0, _M0)
        hi1, lo1 = _mul(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


def uniform24(word: torch.Tensor) -> torch.Tensor:
    """A 32-bit word -> a float32 in [0, 1) from its top 24 bits (every value exact in float32)."""
    return (word >> 8).to(torch.float32) * (1.0 / (1 << 24))
