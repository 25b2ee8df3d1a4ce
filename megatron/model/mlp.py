"""Feed-forward blocks: column-parallel up-projection, row-parallel down-projection.

Shape legend: b batch, s sequence, h hidden, f ffn hidden (f_r = f / tp on this rank).

    GPT-2:          y = GELU_tanh(x W1 + b1) W2 + b2           W1 (h, f) column-, W2 (f, h) row-parallel
                                                               (GELU_erf with config.gelu 'erf': Megatron-LM's F.gelu)
    GPT SwiGLU:     y = (silu(x Wg) * (x Wu)) W2               Wg, Wu fused as one [Wg; Wu] stride-2 GEMM
                                                               (biases only with add_bias_linear)
    T5 v1.0 relu:   y = dropout(relu(x Wi)) Wo
    T5 v1.1 gated:  y = dropout(GELU_tanh(x Wi0) * (x Wi1)) Wo  Wi0, Wi1 fused as one [Wi0; Wi1] stride-2 GEMM
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from .attention import normal_init
from .config import GPTConfig, T5Config
from .rng import SeededDropout


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GPT-2's GELU: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return F.gelu(x, approximate="tanh")


class GPTMLP(nn.Module):
    """(b, s, h) -> (b, s, h); output projection init std / sqrt(2 L). GELU-tanh (GELU-erf with config.gelu
    'erf'), or SwiGLU with config.swiglu (`dense_h_to_4h` then holds [W_gate; W_up], 2f rows)."""

    def __init__(self, config: GPTConfig, tp_group=None, sequence_parallel: bool = False):
        """sequence_parallel: (b, s/t, h) -> (b, s/t, h), the sequence gathered for the GEMMs."""
        super().__init__()
        std, out_std = config.init_method_std, config.init_method_std / math.sqrt(2.0 * config.num_layers)
        common = dict(bias=config.add_bias_linear, tp_group=tp_group, dtype=config.dtype,
                      sequence_parallel=sequence_parallel)
        self.swiglu, f = config.swiglu, config.ffn_hidden_size
        self.approximate = "tanh" if config.gelu == "tanh" else "none"
        self.dense_h_to_4h = mpu.ColumnParallelLinear(config.hidden_size, 2 * f if self.swiglu else f,
                                                      gather_output=False, init_method=normal_init(std),
                                                      stride=2 if self.swiglu else 1, **common)
        self.dense_4h_to_h = mpu.RowParallelLinear(f, config.hidden_size, input_is_parallel=True,
                                                   init_method=normal_init(out_std), **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.dense_h_to_4h(x)  # (b, s, f_r), or (b, s, 2 f_r) with SwiGLU
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate=self.approximate)
        out, _ = self.dense_4h_to_h(h)
        return out


class T5MLP(nn.Module):
    """(b, s, h) -> (b, s, h), no biases; the inner dropout keeps this rank's columns of the whole mask."""

    def __init__(self, config: T5Config, module_number: int, site: int, tp_group=None,
                 sequence_parallel: bool = False):
        super().__init__()
        group, tp_rank, tp_size = mpu.mappings.resolve_group(tp_group)
        d, f, factor = config.hidden_size, config.ffn_hidden_size, config.initializer_factor
        self.gated = config.feed_forward_proj == "gated-gelu"
        self.wi = mpu.ColumnParallelLinear(d, 2 * f if self.gated else f, bias=False, gather_output=False,
                                           init_method=normal_init(factor * d ** -0.5),
                                           stride=2 if self.gated else 1, tp_group=group,
                                           dtype=config.dtype, sequence_parallel=sequence_parallel)
        self.wo = mpu.RowParallelLinear(f, d, bias=False, input_is_parallel=True,
                                        init_method=normal_init(factor * f ** -0.5), tp_group=group,
                                        dtype=config.dtype, sequence_parallel=sequence_parallel)
        self.dropout = SeededDropout(config.hidden_dropout, config.seed, module_number, site,
                                     part=(-1, tp_rank, tp_size))  # this rank's columns of (b, s, f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.wi(x)  # (b, s, f_r) or (b, s, 2 f_r)
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = gelu_tanh(gate) * up
        else:
            h = F.relu(h)
        out, _ = self.wo(self.dropout(h))
        return out


GPT2MLP = GPTMLP  # the earlier name, for code written against it
