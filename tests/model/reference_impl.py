"""Independent, loop-level reimplementations of GPT-2 and T5 (the HF / original papers' math), written
from scratch against the plain model's TP=1 weights to check the architecture, weight layouts included.

GPT-2: QKV rows [Q; K; V] (HF c_attn transposed), scores / sqrt(d), causal softmax, GELU-tanh written
out, pre-LayerNorm, tied head. T5: mesh-tensorflow's relative position bucket (scalar Python), RMS norm,
no score scaling, K/V rows [K; V], gated-GELU or ReLU, final norms, tied head scaled by d_model^-0.5 or
(v1.1) an untied `lm_head.weight` without scaling.
"""
from __future__ import annotations

import math

import torch

BIG = 1e9


def _ln(x, w, b, eps):
    mu = x.mean(-1, keepdim=True)
    var = ((x - mu) ** 2).mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(var + eps) * w + b


def _rms(x, w, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * w


def _gelu(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def _attend(q, k, v, n, scale, bias):
    """q (b, sq, n*d), k/v (b, sk, n*d), bias broadcastable to (b, n, sq, sk) -> (b, sq, n*d)."""
    b, sq, _ = q.shape
    sk = k.shape[1]
    q, k, v = (t.reshape(b, -1, n, t.shape[-1] // n).permute(0, 2, 1, 3) for t in (q, k, v))
    p = torch.softmax(q @ k.transpose(-1, -2) * scale + bias, dim=-1)
    return (p @ v).permute(0, 2, 1, 3).reshape(b, sq, -1)


def gpt2_logits(sd: dict, cfg, tokens: torch.Tensor) -> torch.Tensor:
    """(b, s) -> (b, s, V) from GPT2Model's state dict at TP=1."""
    b, s = tokens.shape
    n, d, eps = cfg.num_attention_heads, cfg.kv_channels, cfg.layernorm_epsilon
    x = sd["embedding.word_embeddings.weight"][tokens] + sd["embedding.position_embeddings.weight"][:s]
    causal = torch.triu(torch.full((s, s), -BIG), 1)
    for i in range(cfg.num_layers):
        p = lambda name: sd[f"layers.{i}.{name}"]  # noqa: E731
        h = _ln(x, p("input_layernorm.weight"), p("input_layernorm.bias"), eps)
        qkv = h @ p("self_attention.query_key_value.weight").t() + p("self_attention.query_key_value.bias")
        q, k, v = qkv.split(n * d, dim=-1)
        a = _attend(q, k, v, n, 1.0 / math.sqrt(d), causal)
        x = x + a @ p("self_attention.dense.weight").t() + p("self_attention.dense.bias")
        h = _ln(x, p("post_attention_layernorm.weight"), p("post_attention_layernorm.bias"), eps)
        h = _gelu(h @ p("mlp.dense_h_to_4h.weight").t() + p("mlp.dense_h_to_4h.bias"))
        x = x + h @ p("mlp.dense_4h_to_h.weight").t() + p("mlp.dense_4h_to_h.bias")
    x = _ln(x, sd["final_layernorm.weight"], sd["final_layernorm.bias"], eps)
    return x @ sd["embedding.word_embeddings.weight"][:cfg.vocab_size].t()


def t5_bucket(relative_position: int, bidirectional: bool, num_buckets: int, max_distance: int) -> int:
    """Mesh TensorFlow's _relative_position_bucket for one distance (key - query)."""
    ret, n = 0, -relative_position
    if bidirectional:
        num_buckets //= 2
        ret += num_buckets if n < 0 else 0
        n = abs(n)
    else:
        n = max(n, 0)
    max_exact = num_buckets // 2
    if n < max_exact:
        return ret + n
    val = max_exact + int(math.log(n / max_exact) / math.log(max_distance / max_exact) * (num_buckets - max_exact))
    return ret + min(val, num_buckets - 1)


def _t5_bias(table, sq, sk, bidirectional, cfg):
    """table (B, n) -> (1, n, sq, sk)."""
    idx = torch.tensor([[t5_bucket(j - i, bidirectional, cfg.relative_attention_num_buckets,
                                   cfg.relative_attention_max_distance) for j in range(sk)] for i in range(sq)])
    return table[idx].permute(2, 0, 1).unsqueeze(0)


def _t5_stack(sd, cfg, prefix, count, x, bias, enc=None, cross=None):
    n, d, eps = cfg.num_attention_heads, cfg.kv_channels, cfg.layernorm_epsilon
    for i in range(count):
        p = lambda name: sd[f"{prefix}.{i}.{name}"]  # noqa: E731
        h = _rms(x, p("self_attention_layernorm.weight"), eps)
        k, v = (h @ p("self_attention.kv.weight").t()).split(n * d, dim=-1)
        x = x + _attend(h @ p("self_attention.q.weight").t(), k, v, n, 1.0, bias) @ p("self_attention.o.weight").t()
        if enc is not None:
            h = _rms(x, p("cross_attention_layernorm.weight"), eps)
            k, v = (enc @ p("cross_attention.kv.weight").t()).split(n * d, dim=-1)
            a = _attend(h @ p("cross_attention.q.weight").t(), k, v, n, 1.0, cross)
            x = x + a @ p("cross_attention.o.weight").t()
        h = _rms(x, p("mlp_layernorm.weight"), eps) @ p("mlp.wi.weight").t()
        if cfg.feed_forward_proj == "gated-gelu":
            g, u = h.chunk(2, dim=-1)
            h = _gelu(g) * u
        else:
            h = torch.relu(h)
        x = x + h @ p("mlp.wo.weight").t()
    return x


def t5_logits(sd: dict, cfg, enc_tokens, dec_tokens, enc_mask, dec_mask, cross_mask) -> torch.Tensor:
    """T5Model's state dict at TP=1 -> (b, sd, V); masks bool True = masked."""
    emb = sd["embedding.word_embeddings.weight"]
    se, sdl = enc_tokens.shape[1], dec_tokens.shape[1]
    enc_bias = _t5_bias(sd["encoder_layers.0.self_attention.relative_attention_bias.weight"], se, se, True, cfg)
    dec_bias = _t5_bias(sd["decoder_layers.0.self_attention.relative_attention_bias.weight"], sdl, sdl, False, cfg)
    enc = _t5_stack(sd, cfg, "encoder_layers", cfg.num_layers, emb[enc_tokens], enc_bias - BIG * enc_mask)
    enc = _rms(enc, sd["encoder_final.final_layernorm.weight"], cfg.layernorm_epsilon)
    dec = _t5_stack(sd, cfg, "decoder_layers", cfg.num_decoder_layers, emb[dec_tokens], dec_bias - BIG * dec_mask,
                    enc, -BIG * cross_mask)
    dec = _rms(dec, sd["decoder_final.final_layernorm.weight"], cfg.layernorm_epsilon)
    if not cfg.tie_word_embeddings:  # v1.1: own output weight, no d_model^-0.5 scaling
        return dec @ sd["lm_head.weight"][:cfg.vocab_size].t()
    return (dec * cfg.hidden_size ** -0.5) @ emb[:cfg.vocab_size].t()
