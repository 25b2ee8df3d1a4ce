"""Normalisations: LayerNorm (GPT-2) and RMSNorm (T5, Llama-family GPT), both computed in fp32 and cast back.

    LayerNorm  y = (x - mean(x)) / sqrt(var(x) + eps) * w + b
    RMSNorm    y = x / sqrt(mean(x^2) + eps) * w           (T5: no mean subtraction, no bias)

On CUDA with apex installed, LayerNorm is apex's FusedLayerNorm (same math, one kernel); elsewhere torch.
Parameters are replicated across tensor-parallel ranks (their gradients agree across the tp group).

The query / key norms of the GPT layer's options (`attention`) act on this rank's heads, (b, n_r, s, d): b batch,
s sequence, n_r heads (or key/value groups) on this tp rank, d per-head width (kv_channels).

    HeadNorm           --qk-layernorm (Megatron-LM's; Qwen3's q_norm / k_norm): LayerNorm or RMSNorm over each
                       head's d channels, one weight (d) shared by every head and replicated over tp
    ProjectionRMSNorm  --qk-layernorm-full (OLMo-2's q_norm / k_norm): RMSNorm over a token's whole query (key)
                       projection, all n heads' n d channels at once, weight (n d) split over tp with the heads:
                       y = x / sqrt(sum over every rank's heads of x^2 / (n d) + eps) * w_r
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from tds import device as tds_device


def _fused_layer_norm_cls():
    if not tds_device.is_cuda():
        return None
    try:
        from apex.normalization import FusedLayerNorm
    except ImportError:
        return None
    return FusedLayerNorm


def layer_norm_fn(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float) -> torch.Tensor:
    """LayerNorm over the last dim, statistics and affine transform in fp32, output in x's dtype."""
    if x.dtype == weight.dtype:  # torch's kernels accumulate bf16/fp16 in fp32 themselves: no casts
        return F.layer_norm(x, weight.shape, weight, bias, eps)
    return F.layer_norm(x.float(), weight.shape, weight.float(), bias.float(), eps).to(x.dtype)


def rms_norm_fn(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * w over the last dim, the variance in fp32, output in x's dtype."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


class LayerNorm(nn.Module):
    """(..., h) -> (..., h); statistics and affine transform in fp32, output in the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=tds_device.device(), dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=tds_device.device(), dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm_fn(x, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """T5 LayerNorm: (..., h) -> (..., h), y = x * rsqrt(mean(x^2) + eps) * w, variance in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=tds_device.device(), dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm_fn(x, self.weight, self.eps)


class HeadNorm(nn.Module):
    """--qk-layernorm: (b, n_r, s, d) -> (b, n_r, s, d), LayerNorm or RMSNorm over each head's d channels with one
    weight (d) [and bias] for every head (Megatron-LM's q_layernorm / k_layernorm, Qwen3's q_norm / k_norm).

    The weights are replicated over the tensor-parallel group, but each rank applies them to its own heads only,
    so autograd gives a rank the gradient of its heads. They enter the computation through f
    (`copy_to_tensor_model_parallel_region`: identity forward, all-reduce backward), so that after backward every
    rank holds the sum over all heads: one all-reduce of d (2d) elements per norm and backward, wherever the
    layer runs (plain model, any pipeline schedule, ZB-H1's B, recomputation). Megatron-LM sums the same
    gradients once per step instead (finalize_model_grads). Not sequence-parallel: queries and keys cover the
    whole sequence on every rank.
    """

    def __init__(self, normalization: str, width: int, eps: float, dtype: torch.dtype, tp_group=None):
        super().__init__()
        if normalization not in ("LayerNorm", "RMSNorm"):
            raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
        self.eps, self.rms = eps, normalization == "RMSNorm"
        self.tp_group, _, self.tp_size = mpu.mappings.resolve_group(tp_group)
        self.weight = nn.Parameter(torch.ones(width, device=tds_device.device(), dtype=dtype))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(width, device=tds_device.device(), dtype=dtype))

    def _shared(self, param: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        if param is None or self.tp_size == 1:
            return param
        return mpu.copy_to_tensor_model_parallel_region(param, self.tp_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (b, n_r, s, d), as `attention` splits heads: a transposed view of (b, s, n_r, d). The result keeps that
        layout (LayerNorm's kernel writes a contiguous output: it runs on (b, s, n_r, d)), so that the attention
        core's output, laid out like the queries, is the merged context itself (a view, not a copy)."""
        weight = self._shared(self.weight)
        if self.rms:
            return rms_norm_fn(x, weight, self.eps)
        return layer_norm_fn(x.transpose(1, 2), weight, self._shared(self.bias), self.eps).transpose(1, 2)


class ProjectionRMSNorm(nn.Module):
    """--qk-layernorm-full: (b, n_r, s, d) -> (b, n_r, s, d), RMSNorm over the n d channels of all heads of a
    token's projection (OLMo-2's q_norm over heads x kv_channels, k_norm over groups x kv_channels).

    Rank r holds heads r n/t .. (r+1) n/t - 1 and the same rows of the weight (n d): split along dim 0 with stride 1,
    marked like a column-parallel weight (`set_tensor_model_parallel_attributes`), so the checkpoint name tables
    and the reshape rules cut it with the heads. The mean of squares needs every rank's heads: this rank's sum of
    squares (b, 1, s, 1) is all-reduced over the tp group, forward and backward
    (`sum_over_tensor_model_parallel_region`): one small all-reduce each way per norm. Queries and keys cover the
    whole sequence on every rank, with or without sequence parallelism, so the norm is not sequence-parallel.
    """

    def __init__(self, width: int, heads: int, eps: float, dtype: torch.dtype, tp_group=None):
        """width: n d of the whole projection; heads: n (query heads or key/value groups)."""
        super().__init__()
        self.tp_group, _, self.tp_size = mpu.mappings.resolve_group(tp_group)
        if heads % self.tp_size:
            raise ValueError(f"{heads} heads do not split over the tensor-model-parallel size {self.tp_size}")
        self.eps, self.width, self.local_heads = eps, width, heads // self.tp_size
        self.weight = nn.Parameter(torch.ones(width // self.tp_size, device=tds_device.device(), dtype=dtype))
        mpu.set_tensor_model_parallel_attributes(self.weight, True, 0, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        squares = x32.pow(2).sum(dim=(1, 3), keepdim=True)  # (b, 1, s, 1): this rank's heads
        if self.tp_size > 1:
            squares = mpu.sum_over_tensor_model_parallel_region(squares, self.tp_group)
        y = x32 * torch.rsqrt(squares / self.width + self.eps)
        return (y * self.weight.float().view(self.local_heads, 1, -1)).to(x.dtype)


def layer_norm(hidden_size: int, eps: float, dtype: torch.dtype) -> nn.Module:
    """LayerNorm module: apex FusedLayerNorm on CUDA when importable, `LayerNorm` otherwise."""
    fused = _fused_layer_norm_cls()
    if fused is None:
        return LayerNorm(hidden_size, eps, dtype)
    return fused(hidden_size, eps=eps).to(device=tds_device.device(), dtype=dtype)


def norm(normalization: str, hidden_size: int, eps: float, dtype: torch.dtype) -> nn.Module:
    """'LayerNorm' (`layer_norm`) or 'RMSNorm'."""
    if normalization == "RMSNorm":
        return RMSNorm(hidden_size, eps, dtype)
    if normalization != "LayerNorm":
        raise ValueError(f"normalization must be 'LayerNorm' or 'RMSNorm', got {normalization!r}")
    return layer_norm(hidden_size, eps, dtype)
