"""T5 relative position bias, split by attention heads across tensor-parallel ranks.

Shape legend: n heads (n_r = n / tp on this rank), q query length, k key length, B buckets.

    bucket(d) for d = key_position - query_position   (HF T5 `_relative_position_bucket`):
        bidirectional (encoder): half the buckets for d > 0; causal (decoder): only d <= 0 is bucketed
        |d| < B'/2 exact, then log-spaced up to max_distance, clipped to the last bucket
    bias[h, i, j] = table[bucket(j - i), h]

The bias depends on j - i only, so it is carried as its "compact" form c[h, t] = table[bucket(t - (q-1)), h]
for t in [0, q+k-1) (all distances from -(q-1) to k-1) and expanded on use: bias[h, i, j] = c[h, j - i + q - 1].
Expanding is a gather, so gradients reach the table exactly as from the full bias.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from megatron import mpu
from tds import device as tds_device


def relative_position_bucket(relative_position: torch.Tensor, bidirectional: bool, num_buckets: int,
                             max_distance: int) -> torch.Tensor:
    """Bucket index (long, same shape) of each key-minus-query distance (HF T5, bit for bit)."""
    buckets = torch.zeros_like(relative_position)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative_position > 0).long() * num_buckets
        distance = relative_position.abs()
    else:
        distance = -torch.clamp(relative_position, max=0)
    max_exact = num_buckets // 2
    is_small = distance < max_exact
    large = max_exact + (torch.log(distance.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).long()
    large = torch.clamp(large, max=num_buckets - 1)
    return buckets + torch.where(is_small, distance, large)


class RelativePositionBias(nn.Module):
    """Bucketed bias table (B, n_r): this rank's heads' columns of the full (B, n) table.

    The full table is drawn from the CPU generator (normal, std `init_std`) and sliced, as the mpu layers
    do, so every tp size holds slices of the same table.
    """

    def __init__(self, num_heads: int, num_buckets: int, max_distance: int, bidirectional: bool,
                 init_std: float, tp_group=None, dtype: torch.dtype = torch.float32):
        super().__init__()
        group, tp_rank, tp_size = mpu.mappings.resolve_group(tp_group)
        n_local = mpu.divide(num_heads, tp_size)
        self.num_buckets, self.max_distance, self.bidirectional = num_buckets, max_distance, bidirectional
        master = torch.empty(num_buckets, num_heads).normal_(0.0, init_std)
        part = master[:, tp_rank * n_local:(tp_rank + 1) * n_local]
        self.weight = nn.Parameter(part.to(device=tds_device.device(), dtype=dtype).contiguous())
        mpu.set_tensor_model_parallel_attributes(self.weight, True, 1, 1)

    def compact(self, query_length: int, key_length: int) -> torch.Tensor:
        """c (n_r, q+k-1): bias of every distance j - i from -(q-1) to k-1."""
        distance = torch.arange(-(query_length - 1), key_length, device=self.weight.device)
        buckets = relative_position_bucket(distance, self.bidirectional, self.num_buckets, self.max_distance)
        return self.weight[buckets].t()  # (n_r, q+k-1)

    def bias(self, query_start: int, query_length: int, key_length: int) -> torch.Tensor:
        """(1, n_r, q, k): bias of queries at positions query_start .. query_start+q-1 over keys 0 .. k-1
        (incremental decoding; equals the last q rows of the full bias when query_start + q = k)."""
        i = torch.arange(query_start, query_start + query_length, device=self.weight.device).unsqueeze(1)
        j = torch.arange(key_length, device=self.weight.device).unsqueeze(0)
        buckets = relative_position_bucket(j - i, self.bidirectional, self.num_buckets, self.max_distance)
        return self.weight[buckets].permute(2, 0, 1).unsqueeze(0)  # (q, k, n_r) -> (1, n_r, q, k)


def expand_compact_bias(compact: torch.Tensor, query_length: int, key_length: int) -> torch.Tensor:
    """(n_r, q+k-1) -> (1, n_r, q, k) with bias[h, i, j] = compact[h, j - i + q - 1]."""
    i = torch.arange(query_length, device=compact.device).unsqueeze(1)
    j = torch.arange(key_length, device=compact.device).unsqueeze(0)
    return compact[:, j - i + query_length - 1].unsqueeze(0)
