"""Multi-head attention on tensor-parallel layers; heads are split across tp ranks.

Shape legend: b batch, s / q / k sequence lengths, h hidden, n heads (n_r = n / tp on this rank),
d per-head width (kv_channels), G key/value groups (G_r = G / tp on this rank; G = n without grouped-query
attention).

Masks are bool with True = masked out (the data pipeline's convention), broadcastable to (b, 1, q, k).
scaled_dot_product_attention wants the opposite for bool masks (True = attend), or an additive float mask.

    GPT-2: softmax(Q K^T / sqrt(d) + causal/attention mask) V       fused QKV (stride 3, [Q; K; V] rows)
    GPT with grouped-query attention: query head i attends with key/value group i // (n / G); the fused QKV's
           rows are [Q (n d); K (G d); V (G d)], block stride (n, G, G) (`mpu.utils`). Rotary positions
           (`position.RotaryEmbedding`) rotate Q and K after the projection; a query / key norm
           (--qk-layernorm: each head's d channels, `layer_norm.HeadNorm`; --qk-layernorm-full: all heads' n d
           channels, `layer_norm.ProjectionRMSNorm`) comes between the two.
    T5:    softmax(Q K^T + position bias + mask) V                  no 1/sqrt(d) (folded into T5's init)

Selective recomputation (config.recompute_granularity == 'selective', Korthikanti et al. 2022 section 5): the
attention core softmax(Q K^T + bias) V with its dropout runs under a checkpoint that keeps only q, k, v and the
mask/bias, and recomputes in backward (dropout replayed). The s^2 probabilities are stored by SDPA's math kernel
and by `attention_core`'s explicit form (CPU with attention dropout > 0); SDPA's fused kernels (flash,
memory-efficient: CUDA, and the CPU flash kernel without dropout) store none, and on a GPU, where SDPA says it
takes one, selective leaves the core alone (no checkpoint, nothing recomputed).

Attention dropout masks do not depend on tp on CPU (`attention_core`): a rank's heads draw the single process's
masks of those heads.

Inference only (megatron.inference.kv_cache): with `kv_cache`, this call's keys/values (b, n_r, q, d) are
appended by `kv_cache.update(k, v)`, which returns every position so far (b, n_r, t, d), and the queries
attend over those t keys (the mask / bias must then cover (q, t)). A cache with `frozen` set already holds
cross-attention keys/values of the encoder output (`kv_cache.keys`, `kv_cache.values`): no projection.
"""
from __future__ import annotations

import math
from typing import Callable, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from megatron import mpu
from .config import GPTConfig, T5Config
from .layer_norm import HeadNorm, ProjectionRMSNorm
from .position import RelativePositionBias, rotary_embedding
from .rng import SeededDropout, replay_checkpoint


def check_heads(num_heads: int, tp_size: int) -> int:
    """Heads on each tp rank; an error naming both numbers if they do not divide."""
    if num_heads % tp_size:
        raise ValueError(f"num_attention_heads ({num_heads}) is not divisible by the tensor-model-parallel "
                         f"size ({tp_size}); choose a tp size that divides the number of heads")
    return num_heads // tp_size


def check_groups(num_groups: int, tp_size: int) -> int:
    """Key/value groups on each tp rank; an error naming both numbers if they do not divide."""
    if num_groups % tp_size:
        raise ValueError(f"num_query_groups ({num_groups}) is not divisible by the tensor-model-parallel size "
                         f"({tp_size}); choose a tp size that divides the number of query groups")
    return num_groups // tp_size


def mask_to_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool mask (True = masked) -> additive float mask: dtype's minimum where masked, 0 elsewhere.

    Half the dtype's minimum (not -inf) keeps fully masked rows finite (uniform attention, as Megatron's
    -10000) and leaves room to add a position bias without overflowing to -inf in fp16.
    """
    fill = torch.finfo(dtype).min / 2
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(mask, fill)


def normal_init(std: float) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda w: nn.init.normal_(w, 0.0, std)


def _split_heads(x: torch.Tensor, n_local: int) -> torch.Tensor:
    """(b, s, n_r * d) -> (b, n_r, s, d)."""
    b, s, _ = x.shape
    return x.view(b, s, n_local, -1).transpose(1, 2)


def _merge_heads(x: torch.Tensor) -> torch.Tensor:
    """(b, n_r, s, d) -> (b, s, n_r * d)."""
    b, n, s, d = x.shape
    return x.transpose(1, 2).reshape(b, s, n * d)


def attention_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor],
                   drop: SeededDropout, scale: Optional[float] = None, is_causal: bool = False,
                   explicit: bool = False) -> torch.Tensor:
    """softmax(Q K^T scale + mask) V with `drop` on the probabilities: q (b, n_r, q, d), k, v (b, G_r, k, d) ->
    (b, n_r, q, d), query head i using key/value head i // (n_r / G_r) (G_r = n_r: multi-head). mask: bool
    (True = attend) or additive float, broadcastable to (b, n_r, q, k); is_causal: position i attends to keys
    <= i; scale None = 1/sqrt(d).

    Without dropout: scaled_dot_product_attention (a fused kernel where one applies). With dropout on CPU, the
    explicit form whose mask is `drop.keep_mask`: this rank's heads of the mask the single process draws for all
    n heads, so the masks do not depend on tp (`rng`). SDPA would run its math kernel here anyway (its CPU flash
    kernel takes no dropout), and this keeps what that kernel keeps: the probabilities, the mask and the dropped
    probabilities, computed in fp32 for half-precision inputs. On other devices SDPA's fused kernels draw the mask
    themselves, on a stream per tp rank (`drop.rng(per_part=True)`, Megatron's rule): there the masks depend on tp,
    unless `explicit` (--layout-invariant) asks for the explicit form on every device.
    """
    gqa = k.size(1) != q.size(1)
    if not drop.active:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                              enable_gqa=gqa)
    if q.device.type != "cpu" and not (explicit or drop.keyed):
        return _fused_dropout_attention(q, k, v, mask, drop, scale, is_causal, gqa)
    if gqa:  # (b, G_r, k, d) -> (b, n_r, k, d): each group's keys and values for its n / G query heads
        k, v = (t.repeat_interleave(q.size(1) // k.size(1), dim=1) for t in (k, v))
    dtype = q.dtype
    q, k, v = q.float(), k.float(), v.float()
    scores = torch.matmul(q, k.transpose(-2, -1)) * (q.size(-1) ** -0.5 if scale is None else scale)  # (b, n_r, q, k)
    if is_causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        if mask.dtype == torch.bool:  # additive, so that autograd keeps no mask (as SDPA's math kernel)
            mask = mask_to_bias(~mask, scores.dtype)
        scores = scores + mask
    probs = torch.softmax(scores, dim=-1) * drop.keep_mask(scores.shape, scores.dtype, scores.device)
    return torch.matmul(probs, v).to(dtype)


@torch.compiler.disable  # --compile: the kernel draws its mask from the site's seeded generator, outside a graph
def _fused_dropout_attention(q, k, v, mask, drop: SeededDropout, scale, is_causal: bool, gqa: bool) -> torch.Tensor:
    with drop.rng(per_part=True):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=drop.p, is_causal=is_causal,
                                              scale=scale, enable_gqa=gqa)


def core(attention: nn.Module, function: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    """The attention core `function(q, k, v, mask_or_bias)`, recomputed in backward under selective recomputation
    where it stores the s^2 tensors; where SDPA runs a fused kernel it stores none, and recomputing it would
    only cost time (4 % of GPT-2 medium's step on an H100), so it runs once."""
    if attention.recompute_core and attention.training and torch.is_grad_enabled():
        return _selective_core(attention, function, *args)
    return function(*args)


@torch.compiler.disable  # --compile: the recomputing checkpoint (with its RNG replay) runs between the graphs
def _selective_core(attention: nn.Module, function: Callable[..., torch.Tensor], *args) -> torch.Tensor:
    if _fused_kernel(attention.attention_dropout, *args):
        return function(*args)
    return replay_checkpoint(function, [attention.attention_dropout], *args)


def _fused_kernel(drop: SeededDropout, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: Optional[torch.Tensor]) -> bool:
    """Whether scaled_dot_product_attention takes a fused kernel (flash or memory-efficient) for this call on a
    GPU; on CPU `attention_core` runs its explicit form with dropout, and the math kernel without it."""
    if q.device.type != "cuda":
        return False
    from torch.backends.cuda import SDPAParams, can_use_efficient_attention, can_use_flash_attention
    params = SDPAParams(q, k, v, mask, drop.p if drop.active else 0.0, mask is None, k.size(1) != q.size(1))
    return can_use_flash_attention(params) or can_use_efficient_attention(params)


class GPT2SelfAttention(nn.Module):
    """(b, s, h) -> (b, s, h). QKV weight rows [Q; K; V] as HF GPT-2's c_attn (transposed) and HF Llama's
    q_proj, k_proj, v_proj stacked; the stride gives each rank the queries of its heads and the keys and values
    of its groups (3, or the blocks (n, G, G) with grouped-query attention). Output projection init
    std / sqrt(2 L) (GPT-2's residual scaling). Rotary positions, when configured, rotate q and k of positions
    0 .. s-1 (continuing after the cached positions when decoding with a kv_cache). With --qk-layernorm (per head)
    or --qk-layernorm-full (over the whole projection), `q_layernorm` and `k_layernorm` normalise q and k after the
    projection and before the rotation (so the cache holds normalised keys)."""

    def __init__(self, config: GPTConfig, module_number: int, tp_group=None, sequence_parallel: bool = False):
        """sequence_parallel: x is this rank's part of the sequence (b, s/t, h), and so is the output."""
        super().__init__()
        group, tp_rank, tp_size = mpu.mappings.resolve_group(tp_group)
        heads, groups, d = config.num_attention_heads, config.num_query_groups, config.kv_channels
        self.n_local = check_heads(heads, tp_size)
        self.g_local = check_groups(groups, tp_size)
        std, out_std = config.init_method_std, config.init_method_std / math.sqrt(2.0 * config.num_layers)
        self.query_key_value = mpu.ColumnParallelLinear(
            config.hidden_size, (heads + 2 * groups) * d, bias=config.qkv_bias, gather_output=False,
            init_method=normal_init(std), stride=3 if groups == heads else (heads, groups, groups), tp_group=group,
            dtype=config.dtype, sequence_parallel=sequence_parallel)
        self.dense = mpu.RowParallelLinear(heads * d, config.hidden_size, bias=config.add_bias_linear,
                                           input_is_parallel=True, init_method=normal_init(out_std), tp_group=group,
                                           dtype=config.dtype, sequence_parallel=sequence_parallel)
        self.explicit = config.explicit_attention  # --layout-invariant: no fused kernel's own masks
        self.attention_dropout = SeededDropout(config.attention_dropout, config.seed, module_number, 0,
                                               part=(1, tp_rank, tp_size))  # this rank's heads of (b, n, q, k)
        self.recompute_core = config.recompute_granularity == "selective"
        self.rotary = rotary_embedding(config)
        self.q_layernorm = self.k_layernorm = None
        eps, dtype = config.layernorm_epsilon, config.dtype
        if config.qk_layernorm:
            norm = dict(normalization=config.normalization, width=d, eps=eps, dtype=dtype, tp_group=group)
            self.q_layernorm, self.k_layernorm = HeadNorm(**norm), HeadNorm(**norm)
        elif config.qk_layernorm_full:
            self.q_layernorm = ProjectionRMSNorm(heads * d, heads, eps, dtype, group)
            self.k_layernorm = ProjectionRMSNorm(groups * d, groups, eps, dtype, group)

    def forward(self, x: torch.Tensor, attention_mask: Optional[torch.Tensor], kv_cache=None) -> torch.Tensor:
        qkv, _ = self.query_key_value(x)  # (b, s, (n_r + 2 G_r) d)
        width = qkv.size(-1) // (self.n_local + 2 * self.g_local)
        sizes = (self.n_local * width, self.g_local * width, self.g_local * width)
        q, k, v = qkv.split(sizes, dim=-1)
        q, k, v = _split_heads(q, self.n_local), _split_heads(k, self.g_local), _split_heads(v, self.g_local)
        if self.q_layernorm is not None:  # (b, n_r, s, d), (b, G_r, s, d)
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        if self.rotary is not None:  # (b, n_r, s, d), (b, G_r, s, d) at positions start .. start + s - 1
            start = 0 if kv_cache is None else kv_cache.length
            q, k = self.rotary(q, start), self.rotary(k, start)
        if kv_cache is not None:
            if attention_mask is None:
                raise ValueError("attention with a kv_cache needs an explicit attention_mask (b, 1, q, t)")
            k, v = kv_cache.update(k, v)  # (b, G_r, t, d)
        mask = None if attention_mask is None else ~attention_mask
        ctx = core(self, self._core, q, k, v, mask)  # (b, n_r, s, d)
        out, _ = self.dense(_merge_heads(ctx))
        return out

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor]) -> torch.Tensor:
        """softmax(Q K^T / sqrt(d) + mask) V with attention dropout; mask bool True = attend, None = causal."""
        return attention_core(q, k, v, mask, self.attention_dropout, is_causal=mask is None, explicit=self.explicit)


class T5Attention(nn.Module):
    """T5 self- or cross-attention: (b, q, h) [+ keys/values from (b, k, h)] -> (b, q, h); no biases.

    q and the fused kv projection ([K; V] rows, stride 2) are column-parallel, o row-parallel. The first
    layer of each stack also owns the stack's `RelativePositionBias` (`relative_attention_bias`).
    """

    def __init__(self, config: T5Config, module_number: int, site: int = 0,
                 position_bias: Optional[str] = None, tp_group=None, sequence_parallel: bool = False):
        """site: dropout site number within the layer; position_bias: None, or 'bidirectional' (encoder) /
        'causal' (decoder) for the first layer of a stack, which owns the stack's bias table;
        sequence_parallel: x (and key_value_states) are this rank's parts of their sequences, gathered by the
        projections; the output is reduce-scattered back to (b, q/t, h)."""
        super().__init__()
        group, tp_rank, tp_size = mpu.mappings.resolve_group(tp_group)
        self.n_local = check_heads(config.num_attention_heads, tp_size)
        d, dkv, f = config.hidden_size, config.kv_channels, config.initializer_factor
        inner = config.num_attention_heads * dkv
        common = dict(bias=False, gather_output=False, tp_group=group, dtype=config.dtype,
                      sequence_parallel=sequence_parallel)
        self.q = mpu.ColumnParallelLinear(d, inner, init_method=normal_init(f * (d * dkv) ** -0.5), **common)
        self.kv = mpu.ColumnParallelLinear(d, 2 * inner, init_method=normal_init(f * d ** -0.5), stride=2,
                                           **common)
        self.o = mpu.RowParallelLinear(inner, d, bias=False, input_is_parallel=True,
                                       init_method=normal_init(f * inner ** -0.5), tp_group=group,
                                       dtype=config.dtype, sequence_parallel=sequence_parallel)
        self.explicit = config.explicit_attention  # --layout-invariant: no fused kernel's own masks
        self.attention_dropout = SeededDropout(config.attention_dropout, config.seed, module_number, site,
                                               part=(1, tp_rank, tp_size))  # this rank's heads of (b, n, q, k)
        self.recompute_core = config.recompute_granularity == "selective"
        self.relative_attention_bias = None
        if position_bias is not None:
            if position_bias not in ("bidirectional", "causal"):
                raise ValueError(f"position_bias must be None, 'bidirectional' or 'causal', got {position_bias!r}")
            self.relative_attention_bias = RelativePositionBias(
                config.num_attention_heads, config.relative_attention_num_buckets,
                config.relative_attention_max_distance, position_bias == "bidirectional", f * d ** -0.5,
                tp_group=group, dtype=config.dtype)

    def forward(self, x: torch.Tensor, attn_bias: torch.Tensor, key_value_states: Optional[torch.Tensor] = None,
                kv_cache=None) -> torch.Tensor:
        """attn_bias: additive float (b or 1, n_r or 1, q, k): position bias plus `mask_to_bias(mask)`."""
        q = _split_heads(self.q(x)[0], self.n_local)  # (b, n_r, q, d)
        k, v = self._keys_values(x if key_value_states is None else key_value_states, kv_cache)
        ctx = core(self, self._core, q, k, v, attn_bias.to(q.dtype))  # (b, n_r, q, d)
        out, _ = self.o(_merge_heads(ctx))
        return out

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """softmax(Q K^T + bias) V with attention dropout (no 1/sqrt(d): T5 folds it into the init)."""
        return attention_core(q, k, v, bias, self.attention_dropout, scale=1.0, explicit=self.explicit)

    def _keys_values(self, source: torch.Tensor, kv_cache) -> Tuple[torch.Tensor, torch.Tensor]:
        """(b, k, h) -> keys, values (b, n_r, k, d); with a kv_cache, what it holds after this call."""
        if kv_cache is not None and kv_cache.frozen:  # cross-attention: the encoder's, projected once
            return kv_cache.keys, kv_cache.values
        kv, _ = self.kv(source)  # (b, k, 2 n_r d)
        k, v = (_split_heads(t, self.n_local) for t in kv.chunk(2, dim=-1))
        return (k, v) if kv_cache is None else kv_cache.update(k, v)
