"""Normalisations: LayerNorm (GPT-2) and RMSNorm (T5, Llama-family GPT), both computed in fp32 and cast back.

    LayerNorm  y = (x - mean(x)) / sqrt(var(x) + eps) * w + b
    RMSNorm    y = x / sqrt(mean(x^2) + eps) * w           (T5: no mean subtraction, no bias)

On CUDA with apex installed, LayerNorm is apex's FusedLayerNorm (same math, one kernel); elsewhere torch.
Parameters are replicated across tensor-parallel ranks (their gradients agree across the tp group).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tds import device as tds_device


def _fused_layer_norm_cls():
    if not tds_device.is_cuda():
        return None
    try:
        from apex.normalization import FusedLayerNorm
    except ImportError:
        return None
    return FusedLayerNorm


class LayerNorm(nn.Module):
    """(..., h) -> (..., h); statistics and affine transform in fp32, output in the input dtype."""

    def __init__(self, hidden_size: int, eps: float = 1e-5, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=tds_device.device(), dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden_size, device=tds_device.device(), dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == self.weight.dtype:  # torch's kernels accumulate bf16/fp16 in fp32 themselves: no casts
            return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)
        y = F.layer_norm(x.float(), self.weight.shape, self.weight.float(), self.bias.float(), self.eps)
        return y.to(x.dtype)


class RMSNorm(nn.Module):
    """T5 LayerNorm: (..., h) -> (..., h), y = x * rsqrt(mean(x^2) + eps) * w, variance in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, device=tds_device.device(), dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


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
