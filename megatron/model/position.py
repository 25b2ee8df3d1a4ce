"""Positions inside attention: rotary embeddings (GPT's rope) and T5's relative position bias.

Rotary position embedding (Su et al. 2021; the non-interleaved form of GPT-NeoX, Llama and Megatron-LM):

    theta_i = base^(-2i / r)            i = 0 .. r/2 - 1, r = rotated width (kv_channels x rotary_percent)
    x' = x cos(p theta) + rotate_half(x) sin(p theta)   on the first r channels of each query / key head at
                                                        position p; rotate_half([x1, x2]) = [-x2, x1]
Llama 3.1's scaling ('llama3') divides theta_i by `factor` for wavelengths 2 pi / theta_i above
original_max / low_freq_factor, keeps it below original_max / high_freq_factor and interpolates smoothly between.

T5 relative position bias, split by attention heads across tensor-parallel ranks.

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
from typing import Dict, Optional, Tuple

import torch
from torch import nn

from megatron import mpu
from tds import device as tds_device


def rotary_inverse_frequencies(rotary_dim: int, base: float, scaling: Optional[dict] = None) -> torch.Tensor:
    """theta_i (r/2,) fp32, with Llama 3.1's scaling when `scaling` = dict(factor, low_freq_factor,
    high_freq_factor, original_max_positions)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
    if scaling is None:
        return inv_freq
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    original = scaling["original_max_positions"]
    wavelength = 2 * math.pi / inv_freq
    scaled = torch.where(wavelength > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelength - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding:
    """Rotates queries and keys by their positions (see the module docstring); no parameters.

    The cos / sin tables are computed in fp32 for positions [0, n) on first use per device and dtype and grown
    on demand (generation past the training length), then cast to the activations' dtype.
    """

    def __init__(self, rotary_dim: int, base: float, scaling: Optional[dict] = None):
        self.rotary_dim = rotary_dim
        self.inv_freq = rotary_inverse_frequencies(rotary_dim, base, scaling)
        self._tables: Dict[Tuple[torch.device, torch.dtype], Tuple[torch.Tensor, torch.Tensor]] = {}

    def cos_sin(self, start: int, length: int, device: torch.device, dtype: torch.dtype):
        """cos, sin (length, r) of positions start .. start + length - 1."""
        key = (device, dtype)
        table = self._tables.get(key)
        if table is None or table[0].size(0) < start + length:
            size = max(start + length, 2 * table[0].size(0) if table is not None else 0)
            positions = torch.arange(size, dtype=torch.float32)
            freqs = torch.outer(positions, self.inv_freq)  # (size, r/2)
            angles = torch.cat([freqs, freqs], dim=-1)  # (size, r)
            table = (angles.cos().to(device=device, dtype=dtype), angles.sin().to(device=device, dtype=dtype))
            self._tables[key] = table
        return table[0][start:start + length], table[1][start:start + length]

    def __call__(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """x (b, n, s, d) at positions start .. start + s - 1 -> the same shape, its first r channels rotated."""
        cos, sin = self.cos_sin(start, x.size(-2), x.device, x.dtype)  # (s, r)
        r = self.rotary_dim
        rot, rest = x[..., :r], x[..., r:]
        x1, x2 = rot.chunk(2, dim=-1)
        rotated = rot * cos + torch.cat([-x2, x1], dim=-1) * sin
        return rotated if rest.size(-1) == 0 else torch.cat([rotated, rest], dim=-1)


def rotary_embedding(config) -> Optional[RotaryEmbedding]:
    """The config's RotaryEmbedding, None unless position_embedding_type is 'rope'."""
    if config.position_embedding_type != "rope":
        return None
    scaling = None if config.rope_scaling_factor is None else dict(
        factor=config.rope_scaling_factor, low_freq_factor=config.rope_low_freq_factor,
        high_freq_factor=config.rope_high_freq_factor, original_max_positions=config.rope_original_max_positions)
    return RotaryEmbedding(config.rotary_dim(), config.rotary_base, scaling)


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
