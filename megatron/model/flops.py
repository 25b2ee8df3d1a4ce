"""Model FLOPs per training iteration (matrix multiplications only; one multiply-add = 2 FLOPs).

Legend: B = samples per iteration (global batch), s = sequence length, h = hidden size, d = heads x kv_channels
(attention width), d_kv = G x kv_channels (key/value width: G key/value groups, G = heads without grouped-query
attention, so d_kv = d), f = ffn hidden size, L = layers, V = padded vocabulary.

Forward FLOPs of one transformer layer over B sequences of length s (self-attention):
    QKV projections 2Bsh(d + 2 d_kv) + scores QK^T 2Bs^2d + weighted values 2Bs^2d + output projection 2Bsdh
    + MLP 4Bshf
QKV is 6Bshd with multi-head attention (GPT-2, T5). Grouped-query attention projects G key/value heads,
2Bsh(a + 2G) kv_channels; the scores and values still cover every query head (2Bs^2d each). A gated MLP (GPT's
SwiGLU, T5 v1.1's gated GELU) has two input projections: 6Bshf. Rotary positions, norms, activations and
softmax are not matmuls and are not counted.
A T5 decoder layer adds cross-attention over the encoder length s_e: Q 2Bshd, KV 4Bs_e hd, QK^T and values
4Bs s_e d, output projection 2Bsdh. The logits add 2BshV (tied or untied head alike).

Training = forward + backward (2x forward) = 3x forward; activation recomputation runs the layers' forward
once more, 4x for the layers (the logits are not recomputed):
    total = (3 or 4) * F_layers + 3 * F_logits
With d = h, f = 4h and recompute this is exactly Megatron's 96 B s L h^2 (1 + s/(6h) + V/(16 L h))
(Narayanan et al. 2021); without recompute the layer part is 72 B s L h^2 (1 + s/(6h)), the logits 6 B s h V.
Per device: TFLOP/s = total / (iteration seconds x world size) / 1e12. Each model's spec applies these to its
configuration (`megatron.model.specs`: `spec.flops(config, global batch, padded vocabulary)`). With --checkpoint-activations the
recomputation is counted (hardware FLOPs, the convention of Megatron's published TFLOP/s figures).
"""
from __future__ import annotations

from typing import Optional


def self_attention_layer_flops(b: int, s: int, h: int, d: int, f: int, gated: bool = False,
                               d_kv: Optional[int] = None) -> float:
    """Forward FLOPs of a self-attention + MLP layer (formula in the module docstring); d_kv None = d."""
    mlp = (6 if gated else 4) * b * s * h * f
    qkv = 2 * b * s * h * (d + 2 * (d if d_kv is None else d_kv))
    return qkv + 4 * b * s * s * d + 2 * b * s * d * h + mlp


def cross_attention_flops(b: int, s_dec: int, s_enc: int, h: int, d: int) -> float:
    return 2 * b * s_dec * h * d + 4 * b * s_enc * h * d + 4 * b * s_dec * s_enc * d + 2 * b * s_dec * d * h


def gpt_flops_per_iteration(b: int, s: int, num_layers: int, h: int, d: int, f: int, vocab: int,
                            recompute: bool, d_kv: Optional[int] = None, gated: bool = False) -> float:
    """GPT: `num_layers` layers and the logits; d_kv = query groups x kv_channels with grouped-query attention,
    gated: SwiGLU."""
    layers = num_layers * self_attention_layer_flops(b, s, h, d, f, gated, d_kv)
    logits = 2 * b * s * h * vocab
    return (4 if recompute else 3) * layers + 3 * logits


def t5_flops_per_iteration(b: int, s_enc: int, s_dec: int, num_layers: int, h: int, d: int, f: int, vocab: int,
                           recompute: bool, num_decoder_layers: Optional[int] = None, gated: bool = False) -> float:
    """`num_layers` encoder layers + `num_decoder_layers` (default num_layers) decoder layers (self + cross
    attention + MLP; `gated`: T5 v1.1's gated-GELU MLP)."""
    encoder = num_layers * self_attention_layer_flops(b, s_enc, h, d, f, gated)
    decoder_layers = num_layers if num_decoder_layers is None else num_decoder_layers
    decoder = decoder_layers * (self_attention_layer_flops(b, s_dec, h, d, f, gated)
                                + cross_attention_flops(b, s_dec, s_enc, h, d))
    logits = 2 * b * s_dec * h * vocab
    return (4 if recompute else 3) * (encoder + decoder) + 3 * logits
