"""Key-value caches for incremental decoding: each new token attends over stored keys/values instead of
recomputing the whole sequence.

Shape legend: b batch, n_r heads on this tp rank, t positions stored so far, T capacity, d head width,
se encoder length.

    KVCache    one self-attention: keys, values (b, n_r, T, d), preallocated on the first update and filled
               left to right; `update(k, v)` writes this call's q positions and returns [0, t) as views
    StaticKV   one cross-attention: the encoder output's keys/values (b, n_r, se, d), projected on the first
               decoder step and then `frozen` (the attention skips its projection)
    LayerCache the caches of one layer, as `TransformerLayer` / `T5TransformerLayer` read them

Per new token a layer then costs O(t) for attention (reading t keys) and O(1) for everything else,
instead of O(t) for everything when the sequence is recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch


class KVCache:
    """Self-attention keys and values of one layer, (b, n_r, capacity, d) each."""

    frozen = False  # a self-attention always projects the new positions

    def __init__(self, capacity: int):
        self.capacity, self.length = capacity, 0
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """Store k, v (b, n_r, q, d) at positions [t, t+q); return keys, values (b, n_r, t+q, d)."""
        b, n, q, d = k.shape
        if self.keys is None:
            self.keys = k.new_empty(b, n, self.capacity, d)
            self.values = v.new_empty(b, n, self.capacity, d)
        end = self.length + q
        if end > self.capacity:
            raise RuntimeError(f"KVCache holds {self.capacity} positions; cannot store {q} more after {self.length}")
        self.keys[:, :, self.length:end] = k
        self.values[:, :, self.length:end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class StaticKV:
    """Cross-attention keys and values of one decoder layer: stored once, then `frozen`."""

    def __init__(self):
        self.frozen = False
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None

    def update(self, k: torch.Tensor, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        self.keys, self.values, self.frozen = k, v, True
        return k, v


@dataclass
class LayerCache:
    self_attention: KVCache
    cross_attention: Optional[StaticKV] = None


def decoder_caches(num_layers: int, capacity: int, cross_attention: bool = False) -> List[LayerCache]:
    """One LayerCache per layer; with cross_attention (T5 decoder) a StaticKV for the encoder's K/V too."""
    return [LayerCache(KVCache(capacity), StaticKV() if cross_attention else None) for _ in range(num_layers)]
