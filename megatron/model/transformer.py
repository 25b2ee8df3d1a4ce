"""Transformer layers (GPT-2 and T5) and the loop that runs a stack with activation checkpointing.

Shape legend: b batch, s / q / k sequence lengths, h hidden, n_r heads on this tp rank.

    GPT (pre-norm):  x = x + drop(attn(N1(x), mask));                   x = x + drop(mlp(N2(x)))
                     N LayerNorm (GPT-2) or RMSNorm; attention and MLP as configured (`attention`, `mlp`)
    GPT with --post-sublayer-norm (OLMo-2's reordered norm):
                     x = x + drop(N1(attn(x, mask)));                   x = x + drop(N2(mlp(x)))
                     the norms on the sublayers' outputs, before the dropout and the residual add
    T5 (pre-RMS):    x = x + drop(self_attn(RMS1(x), bias));
                     x = x + drop(cross_attn(RMS2(x), enc, cross_bias))   (decoder only)
                     x = x + drop(ff(RMS3(x)))

With sequence_parallel (and tp > 1) a layer takes and returns this tp rank's part of the sequence, (b, s/t, h):
its LayerNorms, dropouts and residual adds see s/t positions; the column-parallel linears all-gather the
sequence and the row-parallel ones reduce-scatter it (`mpu.mappings`). Attention itself sees all s positions.

A layer is module number `layer_number` of its model (`rng` docstring): it is built under that seed and
its dropout sites are numbered inside it, so a layer is the same wherever it is built and run.

`kv_cache` (inference only): a `megatron.inference.kv_cache.LayerCache`, whose `self_attention` (and, in a
T5 decoder layer, `cross_attention`) cache goes to the attention of the same name (see `attention`).
"""
from __future__ import annotations

from functools import partial
from typing import Optional, Sequence

import torch
from torch import nn

from megatron import mpu
from .attention import GPT2SelfAttention, T5Attention
from .config import GPTConfig, T5Config
from .layer_norm import RMSNorm, norm
from .mlp import GPTMLP, T5MLP
from .moe import MoEMLP
from .rng import SeededDropout, dropout_sites, init_rng, mix, replay_checkpoint, sequence_split


def sequence_part(tp_group, sequence_parallel: bool) -> tuple:
    """(tp_rank, tp_size) when the activations outside the tp regions are split along the sequence, else (0, 1)."""
    _, tp_rank, tp_size = mpu.mappings.resolve_group(tp_group)
    return (tp_rank, tp_size) if sequence_parallel and tp_size > 1 else (0, 1)


def sequence_parallel_norm(module: nn.Module, part: tuple) -> nn.Module:
    """A norm over this rank's part of the sequence: its gradients are summed over the tp group."""
    return mpu.mark_sequence_parallel(module) if part[1] > 1 else module


class TransformerLayer(nn.Module):
    """GPT block: (b, s, h), bool mask (b or 1, 1, s, s) True = masked (None = causal) -> (b, s, h);
    with sequence_parallel (b, s/t, h) -> (b, s/t, h). Pre-norm, or with config.post_sublayer_norm the norms on
    the sublayers' outputs (module docstring)."""

    def __init__(self, config: GPTConfig, layer_number: int, tp_group=None, sequence_parallel: bool = False,
                 ep_group=None):
        """ep_group: the expert-parallel group of a MoE layer's experts (None: every rank holds all of them)."""
        super().__init__()
        self.layer_number = layer_number
        eps, dtype = config.layernorm_epsilon, config.dtype
        part = sequence_part(tp_group, sequence_parallel)
        sp = part[1] > 1
        self.post_sublayer_norm = config.post_sublayer_norm

        def layer_norm() -> nn.Module:
            return sequence_parallel_norm(norm(config.normalization, config.hidden_size, eps, dtype), part)

        def mlp() -> nn.Module:
            if config.moe is None or not config.moe.is_moe_layer(layer_number):
                return GPTMLP(config, tp_group, sequence_parallel=sp)
            return MoEMLP(config.moe, config.hidden_size, init_method_std=config.init_method_std,
                          num_layers=config.num_layers, dtype=dtype, ep_group=ep_group,
                          sequence_group=mpu.mappings.resolve_group(tp_group)[0] if sp else None,
                          expert_seed=mix(config.seed, layer_number))

        with init_rng(config.seed, layer_number):  # the norms draw nothing: the same weights in either order
            if self.post_sublayer_norm:  # Megatron core's names for norms on the sublayers' outputs
                self.self_attention = GPT2SelfAttention(config, layer_number, tp_group, sequence_parallel=sp)
                self.post_self_attn_layernorm = layer_norm()
                self.mlp = mlp()
                self.post_mlp_layernorm = layer_norm()
            else:
                self.input_layernorm = layer_norm()
                self.self_attention = GPT2SelfAttention(config, layer_number, tp_group, sequence_parallel=sp)
                self.post_attention_layernorm = layer_norm()
                self.mlp = mlp()
        self.attention_output_dropout = SeededDropout(config.hidden_dropout, config.seed, layer_number, 1,
                                                      part=sequence_split(part))
        self.mlp_output_dropout = SeededDropout(config.hidden_dropout, config.seed, layer_number, 2, part=sequence_split(part))

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor] = None, kv_cache=None) -> torch.Tensor:
        cache = None if kv_cache is None else kv_cache.self_attention
        if self.post_sublayer_norm:
            # OLMo-2's dropout placement: after the norm, on what the residual adds (OLMo-core's
            # ReorderedNormTransformerBlock.forward: h = x + dropout(attention_norm(attention(x))), the dropout of
            # its ResidualStream; Megatron core's post_self_attn_layernorm also comes before its bias-dropout-add)
            y = self.post_self_attn_layernorm(self.self_attention(x, attention_mask, cache))
            x = x + self.attention_output_dropout(y)
            return x + self.mlp_output_dropout(self.post_mlp_layernorm(self.mlp(x)))
        x = x + self.attention_output_dropout(self.self_attention(self.input_layernorm(x), attention_mask, cache))
        return x + self.mlp_output_dropout(self.mlp(self.post_attention_layernorm(x)))


class T5TransformerLayer(nn.Module):
    """T5 encoder or decoder block. The first layer of a stack (`owns_position_bias`) holds the stack's
    relative position bias table in `self_attention.relative_attention_bias`; every layer receives the
    already-expanded additive bias."""

    def __init__(self, config: T5Config, layer_number: int, is_decoder: bool, owns_position_bias: bool,
                 tp_group=None, sequence_parallel: bool = False):
        """sequence_parallel: x, the output and (decoder) encoder_output are this rank's parts of their
        sequences; cross-attention's keys and values come from the all-gathered encoder output."""
        super().__init__()
        self.layer_number, self.is_decoder = layer_number, is_decoder
        eps, dtype, d, n = config.layernorm_epsilon, config.dtype, config.hidden_size, layer_number
        kind = ("causal" if is_decoder else "bidirectional") if owns_position_bias else None
        part = sequence_part(tp_group, sequence_parallel)
        common = dict(tp_group=tp_group, sequence_parallel=part[1] > 1)
        with init_rng(config.seed, layer_number):
            self.self_attention_layernorm = sequence_parallel_norm(RMSNorm(d, eps, dtype), part)
            self.self_attention = T5Attention(config, n, site=0, position_bias=kind, **common)
            if is_decoder:
                self.cross_attention_layernorm = sequence_parallel_norm(RMSNorm(d, eps, dtype), part)
                self.cross_attention = T5Attention(config, n, site=2, **common)
            self.mlp_layernorm = sequence_parallel_norm(RMSNorm(d, eps, dtype), part)
            self.mlp = T5MLP(config, n, site=4, **common)
        p, seed = config.hidden_dropout, config.seed
        self.self_attention_output_dropout = SeededDropout(p, seed, n, 1, part=sequence_split(part))
        if is_decoder:
            self.cross_attention_output_dropout = SeededDropout(p, seed, n, 3, part=sequence_split(part))
        self.mlp_output_dropout = SeededDropout(p, seed, n, 5, part=sequence_split(part))

    @property
    def position_bias(self):
        return self.self_attention.relative_attention_bias

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor, encoder_output: Optional[torch.Tensor] = None,
                cross_bias: Optional[torch.Tensor] = None, kv_cache=None) -> torch.Tensor:
        """x (b, q, h); attn_bias (b or 1, n_r, q, q) additive; decoder: encoder_output (b, k, h) and
        cross_bias (b or 1, 1, q, k) additive. With kv_cache, attn_bias covers (q, cached + q) keys."""
        self_cache, cross_cache = (None, None) if kv_cache is None else (kv_cache.self_attention,
                                                                         kv_cache.cross_attention)
        y = self.self_attention(self.self_attention_layernorm(x), attn_bias, kv_cache=self_cache)
        x = x + self.self_attention_output_dropout(y)
        if self.is_decoder:
            y = self.cross_attention(self.cross_attention_layernorm(x), cross_bias, encoder_output, cross_cache)
            x = x + self.cross_attention_output_dropout(y)
        return x + self.mlp_output_dropout(self.mlp(self.mlp_layernorm(x)))


def _run_chunk(layers: Sequence[nn.Module], x: torch.Tensor, *extra) -> torch.Tensor:
    for layer in layers:
        x = layer(x, *extra)
    return x


def run_layers(layers: Sequence[nn.Module], x: torch.Tensor, checkpoint_num_layers: int, *extra,
               method: str = "uniform") -> torch.Tensor:
    """x = layer(x, *extra) for each layer; with checkpoint_num_layers = N > 0 (and grad enabled) every run of
    N layers ('uniform'), or each of the first N layers ('block'), keeps only its input and recomputes in
    backward (mpu.checkpoint, dropout replayed)."""
    if checkpoint_num_layers <= 0 or not torch.is_grad_enabled():
        return _run_chunk(layers, x, *extra)
    if method == "block":
        chunks = [[layer] for layer in layers[:checkpoint_num_layers]] + [list(layers[checkpoint_num_layers:])]
        checkpointed = [True] * min(checkpoint_num_layers, len(layers)) + [False]
    else:
        chunks = [list(layers[i:i + checkpoint_num_layers]) for i in range(0, len(layers), checkpoint_num_layers)]
        checkpointed = [True] * len(chunks)
    for chunk, recompute in zip(chunks, checkpointed):
        if not recompute:
            x = _run_chunk(chunk, x, *extra)
            continue
        sites = [s for layer in chunk for s in dropout_sites(layer)]
        x = replay_checkpoint(partial(_run_chunk, chunk), sites, x, *extra)
    return x


def recompute_whole(layer: nn.Module, forward, inputs):
    """forward(inputs), recomputed in backward when the layer is marked `recompute_whole` (block recomputation
    in a pipeline: `mark_block_recompute`); `inputs` is a tensor or a tuple of them."""
    if not getattr(layer, "recompute_whole", False) or not torch.is_grad_enabled():
        return forward(inputs)
    was_tuple = isinstance(inputs, tuple)
    args = inputs if was_tuple else (inputs,)
    return replay_checkpoint(lambda *a: forward(a if was_tuple else a[0]), dropout_sites(layer), *args)


def mark_block_recompute(layers_per_chunk: Sequence[Sequence[nn.Module]], num_layers: int) -> None:
    """--recompute-method block: the first `num_layers` transformer layers of each chunk recompute whole."""
    for layers in layers_per_chunk:
        for layer in layers[:num_layers]:
            layer.recompute_whole = True
