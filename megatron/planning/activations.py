"""Activation bytes one micro-batch leaves saved for backward, per layer spec, as this code base saves them.

Shape legend: b micro-batch, s sequence (T5: s_e encoder, s_d decoder), h hidden, a heads, d kv_channels,
w = a d attention width, G key/value groups (G = a without grouped-query attention), g = G d, f ffn hidden,
V_p padded vocabulary, t tensor-parallel size, e bytes per activation element (4 fp32, 2 bf16).

Counted from the tensors autograd keeps in `megatron.model` (tests/planning/test_activations.py checks each
formula against `torch.autograd.graph.saved_tensors_hooks` on the real layers). A GPT-2 layer saves

    replicated over tp   its input, LN1 out, LN2 in, LN2 out, 2 dropout masks   6 bsh e      (+ 4 LN stats 4bs x 4 B)
    split over tp        q, k, v, context 4 bsw e; MLP in and GELU out 2 bsf e   / t
    attention core       softmax, dropout mask, dropped probabilities        3 a b s^2 e / t

which is Korthikanti et al. (2022)'s sbh(10 + 24/t + 5as/(ht)) with SDPA's math path on CPU and this code's
dtype for the dropout masks: e bytes on CPU, 1 on CUDA (bool) but for SeededDropout's sequence-parallel slices
(e bytes on both). T5's masks are counted at e bytes on both (no GPU measurement of T5 yet). A T5 layer (RMSNorm saves input and normalised input; the inner
dropout of the MLP keeps mask and output) saves 8 bsh e replicated, (4 bsw + 3 bsf) e / t split (gated: 6 bsf),
3 a b s^2 e / t of attention core and the bucket index (s^2 int64) -- RMSNorm computes in fp32, so its input
and normalised input are kept at 4 bytes in bf16 too; a decoder layer adds cross attention:
4 b s_d h e replicated, (2 b s_d w + 2 b s_e w) e / t split and 3 a b s_d s_e e / t.

The GPT layer's options (the Llama family's layer: `megatron.model.config.GPTConfig`) change these terms:

    RMSNorm              each norm keeps its input in fp32 and the normalised input (fp32), 8 bsh, its output
                         e bsh (the next GEMM's input), its rstd 4 bs and, in bf16, the fp32 copy of its weight
                         4h: 2 (8 + e) bsh replicated instead of LayerNorm's 4 bsh e (as T5's)
    SwiGLU               the fused input projection's output (gate and up, 2f), silu(gate) and the product
                         (fc2's input): 4 bsf e / t instead of GELU's 2 bsf e / t
    biases               none kept (a linear keeps its input and weight, with or without a bias)
    hidden dropout 0     no masks (SeededDropout is the identity)
    the attention core   CPU with attention dropout (`attention_core`'s explicit form): q, k, v in fp32 with k, v
                         repeated to a heads, so grouped-query attention keeps what multi-head attention keeps:
                         3 bsw x 4 B + context bsw e, and 3 a b s^2 x 4 B of core.
                         A flash kernel -- CPU's SDPA without attention dropout, a GPU's flash / memory-efficient
                         kernels -- keeps q, k, v as they enter (k, v with G heads: enable_gqa repeats nothing),
                         its output, which is the context (the head merge is a view of it), and the log-sum-exp
                         a b s 4, no s^2 tensor. q, k, v enter as views of the fused QKV output, b s (w + 2g) e,
                         which stays alive whole; rotary positions add the rotated q and k, b s (w + g) e (the
                         rotation keeps only its cos / sin tables, not q and k before it).
                         Selective recomputation keeps the core's inputs as they enter (the same b s (w + 2g)
                         [+ b s (w + g)] e) and the context bsw e; the log-sum-exp too on a GPU (SDPA's fused
                         kernels are not recomputed), none on CPU.
    rotary tables        each layer's RotaryEmbedding caches cos and sin, (s, r) at e bytes, from the first
                         forward on: not per micro-batch, counted with the weights (`memory`)
    query / key norms    --qk-layernorm's RMSNorm keeps its input in fp32 (in fp32 the fused QKV output itself, in
                         bf16 a copy, b s (w + g) 4), the normalised input b s (w + g) 4, its rstd b (a + G) s 4 and
                         in bf16 its weights in fp32 (2 d 4); as LayerNorm its input (the QKV output) and its mean and
                         rstd (2 b (a + G) s, in fp32 on CUDA, in the input's dtype on CPU). The normalised q and k
                         enter the core as the rotated ones do (b s (w + g) e), with or without rotary positions,
                         laid out like the projection's output (so the core's output is still the context). The
                         explicit form keeps the QKV output besides its own q, k, v where a norm keeps it as input.
                         --qk-layernorm-full's RMSNorm over all heads keeps what RMSNorm keeps, its rstd (b, s) once
                         per norm on every rank (2 b s 4) and in bf16 its weights' fp32 copy (w + g) 4 / t
    post-sublayer norms  --post-sublayer-norm keeps the same bytes (measured): a norm's output now goes to the
                         dropout and the residual add, which keep nothing of it, and the GEMM it fed keeps the
                         residual stream instead, of the same size

For GPT-2's layer (G = a, no rotary) the flash terms are 4 bsw e + a b s 4: the `attention="fused"` formula. On
GPUs these are Korthikanti's; the GPU side of the Llama layer follows the same logic, not measured here.

On CPU (`attention="math"`) with attention dropout, the core keeps what SDPA's math path keeps: in bf16 q, k, v and
the three s^2 tensors in fp32 (qkv_e = 4); a GPT without attention dropout runs SDPA's CPU flash kernel (above;
T5's formulas assume dropout). On GPU (`attention="fused"`) the flash / memory-efficient kernels keep the
log-sum-exp instead of the s^2 tensors, and their output, laid out (b, s, a, d), is the context itself after the
head merge (a view): measured on an H100. With micro-batch 1 SDPA keeps v as a view of the fused qkv output, so
its storage (3 bsw) stays alive: the formulas assume b >= 2.

Sequence parallelism (Korthikanti §4.2.2) divides the replicated part by t as well. Selective recomputation
drops the attention core term (recomputed in backward) on the math path; with fused kernels it changes nothing. Full recomputation keeps only each checkpointed
chunk's input (b s h e) and, during the backward, one chunk's activations while it is recomputed.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .model_shape import ModelShape, Spec

__all__ = ["ActivationOptions", "spec_activation_bytes", "layer_bytes", "recomputed_core_bytes", "logit_bytes"]

STATS = 4  # LayerNorm mean / rstd and RMSNorm rstd are kept in fp32


@dataclass(frozen=True)
class ActivationOptions:
    micro_batch: int
    tp: int
    element_bytes: int
    sequence_parallel: bool = False
    recompute: str = "none"     # none | selective | full
    attention: str = "math"     # math: CPU (s^2 probabilities with attention dropout); fused: GPU flash kernels
    loss_fusion: bool = False   # --cross-entropy-loss-fusion: the loss saves the logits (e), not an fp32 softmax


def _mask_bytes(o: ActivationOptions) -> int:
    """Bytes per element of a GPT-2 hidden dropout mask: CUDA's dropout keeps a bool mask (`attention="fused"`
    stands for a GPU), CPU's keeps it in the activations' dtype, and so does SeededDropout's own mask for a
    sequence-parallel slice (megatron/model/rng.py), on either."""
    return 1 if o.attention == "fused" and not o.sequence_parallel else o.element_bytes


def _core_bytes(a: int, b: int, q: int, k: int, qkv_e: int, t: int, o: ActivationOptions) -> float:
    """The attention core's own saved bytes. Math path: probabilities, dropout mask, dropped probabilities
    (3 a b q k, none under selective recomputation). Fused kernels (flash / memory-efficient on a GPU): the
    log-sum-exp, selective or not (the core is not recomputed there); their output is laid out (b, q, a, d),
    so the head merge is a view of it and it is the context the output projection keeps (counted there)."""
    if o.attention == "fused":
        return a * b * q * 4 / t
    return 0 if o.recompute == "selective" else 3 * a * b * q * k * qkv_e / t


def _gpt_layer(b: int, s: int, m: ModelShape, o: ActivationOptions) -> float:
    """A GPT layer: GPT-2's or the Llama family's (module docstring)."""
    h, f, e, t = m.hidden, m.ffn, o.element_bytes, o.tp
    sp = t if o.sequence_parallel else 1
    if m.rms_norm:  # 2 RMSNorms: fp32 input and normalised input, output at e; rstd fp32, bf16: the weight in fp32
        norms, stats = 2 * (8 + e) * b * s * h, 2 * b * s * STATS / sp + (0 if e == 4 else 2 * 4 * h)
    else:  # 2 LayerNorm inputs (no fp32 copies: torch's kernels accumulate in fp32), their outputs
        # LayerNorm's mean and rstd: fp32 on CUDA, the input's dtype on CPU (`attention="math"` stands for CPU)
        norms, stats = 4 * b * s * h * e, 4 * b * s * (STATS if o.attention == "fused" else e)
    masks = 2 * b * s * h * _mask_bytes(o) if m.hidden_dropout > 0 else 0
    attention, core = _gpt_attention(b, s, m, o)
    split = (attention + (4 if m.gated else 2) * b * s * f * e) / t  # SwiGLU: gate and up, silu(gate), product
    return (norms + masks) / sp + split + core + stats


def _gpt_attention(b: int, s: int, m: ModelShape, o: ActivationOptions) -> tuple:
    """(bytes split over tp before the division by t, attention core bytes on this rank) of GPT's attention."""
    w, a, e, t = m.width, m.heads, o.element_bytes, o.tp
    context = b * s * w * e  # the output projection's input
    qkv = b * s * (w + 2 * m.kv_width)  # the fused QKV output's elements
    own_qk = bool(m.rotary_dim or m.qk_norm)  # q and k enter the core as tensors of their own
    # q, k, v as they enter the core: views of the fused QKV output, and the rotated (or normalised) q and k
    entering = (qkv + (b * s * (w + m.kv_width) if own_qk else 0)) * e
    norms = _qk_norm_bytes(b, s, m, o)
    flash = o.attention == "fused" or m.attention_dropout == 0  # no s^2 tensors (CPU: SDPA's flash kernel)
    recomputed = o.recompute == "selective" and o.attention == "math"  # CPU recomputes even a flash core
    if flash:
        return entering + context + norms, 0 if recomputed else a * b * s * STATS / t  # + the log-sum-exp
    if o.recompute == "selective":
        return entering + context + norms, 0
    # the explicit form with dropout: q, k, v in fp32 (k, v repeated to a heads); probabilities, mask, dropped
    return _explicit_qkv(b, s, m, o) + context + norms, 3 * a * b * s * s * 4 / t


def _explicit_qkv(b: int, s: int, m: ModelShape, o: ActivationOptions) -> float:
    """The q, k, v `attention_core`'s explicit form keeps (CPU with attention dropout): a heads each, in fp32, of
    their own (the batched matmuls keep contiguous copies of the head-split views), 3 bsw 4; a query / key norm
    keeps the fused QKV output b s (w + 2g) e as its input besides (RMSNorm in fp32 only: in bf16 its own fp32
    copy, counted with the norm)."""
    kept = m.qk_norm and (o.element_bytes == 4 or not m.rms_norm)  # the norm's input: the QKV output
    return 3 * b * s * m.width * 4 + (b * s * (m.width + 2 * m.kv_width) * o.element_bytes if kept else 0)


def _qk_norm_bytes(b: int, s: int, m: ModelShape, o: ActivationOptions) -> float:
    """What the query / key norms keep besides their input (module docstring), before the division by t (split
    like the heads; --qk-layernorm's bf16 weight copies, 2 d 4 on every rank, are counted as if split too: a few
    bytes; --qk-layernorm-full's rstd, (b, s) for all heads, is on every rank)."""
    if not m.qk_norm:
        return 0
    e, t, rows, heads = o.element_bytes, o.tp, b * s * (m.width + m.kv_width), b * s * (m.heads + m.groups)
    if not m.rms_norm:  # --qk-layernorm as LayerNorm: mean and rstd
        return 2 * heads * (STATS if o.attention == "fused" else e)
    weights = 2 * m.kv_channels * t if m.qk_layernorm else m.width + m.kv_width
    rstd = heads * STATS if m.qk_layernorm else 2 * b * s * STATS * t
    return rows * 4 + rstd + (0 if e == 4 else rows * 4 + weights * 4)


def _t5_self_attention(b: int, s: int, m: ModelShape, o: ActivationOptions) -> float:
    h, w, f, a, e, t = m.hidden, m.width, m.ffn, m.heads, o.element_bytes, o.tp
    qkv_e = 4 if o.attention == "math" else e  # CPU's math SDPA keeps fp32 copies of q, k, v in bf16
    # RMSNorm computes in fp32: input and normalised input kept at 4 bytes; outputs and masks at e
    replicated = 4 * b * s * h * 4 + 4 * b * s * h * e
    mlp = (6 if m.gated else 3) * b * s * f
    # selective: the recomputed core keeps q, k, v as views of the qkv output (e bytes), not SDPA's copies
    qkv_saved = e if o.recompute == "selective" else qkv_e
    split = (3 * b * s * w * qkv_saved + (b * s * w + mlp) * e) / t
    core = _core_bytes(a, b, s, s, qkv_e, t, o)
    stats = 2 * b * s * STATS + 8 * s * s + (0 if e == 4 else 2 * 4 * h)
    if o.sequence_parallel:
        replicated /= t
    return replicated + split + core + stats


def _cross_attention(b: int, s_d: int, s_e: int, m: ModelShape, o: ActivationOptions) -> float:
    h, w, a, e, t = m.hidden, m.width, m.heads, o.element_bytes, o.tp
    qkv_e = 4 if o.attention == "math" else e
    qkv_saved = e if o.recompute == "selective" else qkv_e
    replicated = (2 * b * s_d * h * 4 + 2 * b * s_d * h * e) / (t if o.sequence_parallel else 1)
    split = ((b * s_d * w + 2 * b * s_e * w) * qkv_saved + b * s_d * w * e) / t  # q, k, v; context
    core = _core_bytes(a, b, s_d, s_e, qkv_e, t, o)
    return replicated + split + core + b * s_d * STATS + (0 if e == 4 else 4 * h)


def layer_bytes(spec: Spec, m: ModelShape, o: ActivationOptions) -> float:
    """Saved bytes of one transformer layer spec for one micro-batch (no full recomputation)."""
    b = o.micro_batch
    if spec.kind == "layer":
        return _gpt_layer(b, m.seq, m, o)
    if spec.kind == "enc":
        return _t5_self_attention(b, m.seq, m, o)
    if spec.kind == "dec":
        return _t5_self_attention(b, m.decoder_seq, m, o) + _cross_attention(b, m.decoder_seq, m.seq, m, o)
    return 0.0


def recomputed_core_bytes(spec: Spec, m: ModelShape, o: ActivationOptions) -> float:
    """Selective recomputation: what a layer's attention core holds again while its backward runs -- the bytes
    selective saved (SDPA's math path; 0 where the fused kernels keep no s^2 tensors), and with tp > 1 the whole
    (a, b, s, s) dropout mask SeededDropout draws before keeping this rank's heads (megatron/model/rng.py)."""
    if o.recompute != "selective" or o.attention != "math" or spec.kind not in ("layer", "enc", "dec"):
        return 0.0
    saved = layer_bytes(spec, m, replace(o, recompute="none")) - layer_bytes(spec, m, o)
    s = m.decoder_seq if spec.kind == "dec" else m.seq
    dropout = spec.kind != "layer" or m.attention_dropout > 0  # GPT without it: CPU's flash kernel, no mask
    whole_mask = m.heads * o.micro_batch * s * s * 4 if o.tp > 1 and dropout else 0  # fp32 (attention_core)
    return saved + whole_mask


def logit_bytes(o: ActivationOptions) -> int:
    """Bytes the loss saves per logit: the fp32 softmax (4), or with the fused loss the logits (e)."""
    return o.element_bytes if o.loss_fusion else 4


def spec_activation_bytes(spec: Spec, m: ModelShape, o: ActivationOptions) -> float:
    """Saved bytes of any layer spec for one micro-batch, without full recomputation.

    Embedding: GPT tokens and positions (int64; no positions with rope / none) and the embedding dropout mask
    (bsh e; none without hidden dropout); T5 both stacks'.
    Final norm: its input and output (2 bsh e, T5 RMSNorm 3 bsh e with the dropout mask) and stats; GPT's RMSNorm
    its fp32 input and normalised input, its output, rstd and in bf16 its fp32 weight, (8 + e) bsh + 4 bs (+ 4h).
    Head and loss: the fp32 softmax the vocab-parallel cross entropy saves, b s V_p / t x 4 in every precision
    (the bf16/fp16 logits themselves are not kept), labels and loss mask (8 + 4 + 1 bytes per token); its fused
    form (`loss_fusion`) saves the logits themselves, b s V_p / t x e, and m and S (8 bytes per token).
    """
    b, h, e, t = o.micro_batch, m.hidden, o.element_bytes, o.tp
    s_out = m.decoder_seq if m.model_type == "t5" else m.seq
    if spec.kind in ("layer", "enc", "dec"):
        return layer_bytes(spec, m, o)
    sp = t if o.sequence_parallel else 1  # sequence parallelism splits the hidden states outside the GEMMs
    if spec.kind == "embed":
        if m.model_type == "gpt":
            positions = 8 * m.seq if m.positions else 0
            mask = b * m.seq * h * _mask_bytes(o) / sp if m.hidden_dropout > 0 else 0
            return 8 * b * m.seq + positions + mask
        return 8 * b * (m.seq + s_out) + b * (m.seq + s_out) * h * e / sp
    if spec.kind == "norm":
        s = s_out if m.model_type == "gpt" else m.seq  # approximate: both T5 norms sized by their own stack
        if m.model_type == "gpt" and m.rms_norm:
            return ((8 + e) * b * s * h + b * s * STATS) / sp + (0 if e == 4 else 4 * h)
        return ((3 if m.model_type == "t5" else 2) * b * s * h * e + b * s * STATS) / sp
    if spec.kind == "head":
        return b * s_out * m.padded_vocab(t) // t * logit_bytes(o) + (21 if o.loss_fusion else 13) * b * s_out
    return 0.0
