"""The model as the planner sees it: sizes, the Pipe model's layer specs with their parameters, the partition.

Shape legend: b micro-batch, s sequence (T5: s_e encoder, s_d decoder), h hidden, a heads, d kv_channels,
w = a d (attention width), G key/value groups (grouped-query attention; G = a without it), g = G d (key/value
width), f ffn hidden (f_in = 2f with two input projections: GPT's SwiGLU, T5 v1.1's gated GELU), V_p padded
vocabulary, P learned positions, t tensor-parallel size.

Parameters per layer spec on one tensor-parallel rank (column/row-parallel matrices split by t, biases of
row-parallel outputs and norms replicated), exactly what `megatron.model` builds:

    GPT embedding       V_p h / t  (+ P h replicated with learned positions; none with rope / none)
    GPT layer           (h (w + 2g) [+ (w + 2g) qkv bias] + wh + h f_in + f h [+ f_in]) / t
                        + 2 norms (LayerNorm 2h, RMSNorm h) [+ 2h: the dense and fc2 biases]
                        biases [..] with add_bias_linear; the qkv bias also with add_qkv_bias
                        + 2 query / key norms of d each (LayerNorm 2d) with --qk-layernorm, replicated, or
                        (w + g) / t with --qk-layernorm-full (split with the heads); --post-sublayer-norm moves the
                        2 norms, the same parameters
                        GPT-2 (g = w, f_in = f, biases, LayerNorm): (3hw + 3w + wh + hf + f + fh) / t + 6h
    GPT final norm      2h (LayerNorm) or h (RMSNorm)
    GPT LM head         tied: the embedding again (TiedLayerSpec builds the whole module on the last stage);
                        untied: its own V_p h / t
    T5 embedding        V_p h / t;  untied head V_p h / t
    T5 encoder layer    (hw + 2hw + wh + h f_in + f h) / t + 2h;  first layer + buckets a / t
    T5 decoder layer    encoder layer + cross attention (4hw / t + h)
    T5 final norms      h each

The partition is tds's (`tds.pipe.module._parts`, DeepSpeed's `partition_balanced` over the transformer layers
for the default 'type:TransformerLayer'), re-implemented here without torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Sequence, Tuple

__all__ = ["ModelShape", "Spec", "gpt_layer_options", "layer_specs", "partition", "stage_chunks"]


@dataclass(frozen=True)
class ModelShape:
    model_type: str                 # 'gpt' or 't5'
    num_layers: int                 # GPT layers, or T5 encoder layers
    hidden: int
    heads: int
    kv_channels: int
    ffn: int
    vocab: int                      # the tokenizer's size (unpadded)
    seq: int                        # GPT sequence / T5 encoder length
    decoder_layers: int = 0
    decoder_seq: int = 0
    max_positions: int = 0          # GPT learned positions (default seq)
    divisible_by: int = 128         # --make-vocab-size-divisible-by
    tied: bool = True
    gated: bool = False             # two input projections: T5 v1.1's gated GELU, GPT's SwiGLU
    buckets: int = 32
    # the GPT layer's options (GPTConfig's fields; the defaults are GPT-2's)
    query_groups: int = 0           # G key/value groups; 0 = one per head (multi-head attention)
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    normalization: str = "LayerNorm"                # or 'RMSNorm'
    position_embedding_type: str = "learned_absolute"   # or 'rope' / 'none'
    rotary_percent: float = 1.0
    hidden_dropout: float = 0.1     # GPT: no masks kept at 0
    attention_dropout: float = 0.1  # GPT on CPU: 0 runs SDPA's flash kernel (no s^2 tensors kept)
    # --- the GPT layer options of issue 40 (kept here until the planner's model terms move into the specs) ---
    qk_layernorm: bool = False      # a norm over each query / key head (Qwen3)
    qk_layernorm_full: bool = False  # an RMSNorm over the whole query / key projection (OLMo-2)
    post_sublayer_norm: bool = False  # the norms on the attention / MLP outputs (OLMo-2)

    @property
    def width(self) -> int:
        return self.heads * self.kv_channels

    @property
    def groups(self) -> int:
        """G key/value groups (= heads without grouped-query attention)."""
        return self.query_groups or self.heads

    @property
    def kv_width(self) -> int:
        return self.groups * self.kv_channels

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias

    @property
    def qk_norm(self) -> bool:
        """Whether queries and keys are normalised (--qk-layernorm or --qk-layernorm-full)."""
        return self.qk_layernorm or self.qk_layernorm_full

    @property
    def rms_norm(self) -> bool:
        return self.model_type == "t5" or self.normalization == "RMSNorm"

    @property
    def rotary_dim(self) -> int:
        """Rotated channels of each query / key head with rotary positions, else 0."""
        return int(self.kv_channels * self.rotary_percent) if self.position_embedding_type == "rope" else 0

    @property
    def positions(self) -> int:
        """Rows of the learned position table (0 with rope / none)."""
        return self.max_positions if self.position_embedding_type == "learned_absolute" else 0

    def padded_vocab(self, tp: int) -> int:
        multiple = self.divisible_by * tp
        return -(-self.vocab // multiple) * multiple

    @property
    def transformer_layers(self) -> int:
        return self.num_layers + self.decoder_layers

    @classmethod
    def from_config(cls, model_type: str, cfg, vocab: int) -> "ModelShape":
        """From a GPTConfig / T5Config (or anything with their fields) and the unpadded vocabulary."""
        common = dict(model_type=model_type, num_layers=cfg.num_layers, hidden=cfg.hidden_size,
                      heads=cfg.num_attention_heads, kv_channels=cfg.kv_channels or cfg.hidden_size //
                      cfg.num_attention_heads, ffn=cfg.ffn_hidden_size or 4 * cfg.hidden_size, vocab=vocab,
                      seq=cfg.seq_length, divisible_by=cfg.make_vocab_size_divisible_by)
        if model_type == "t5":
            return cls(**common, decoder_layers=cfg.num_decoder_layers or cfg.num_layers,
                       decoder_seq=cfg.decoder_seq_length or cfg.seq_length, tied=cfg.tie_word_embeddings,
                       gated=cfg.feed_forward_proj == "gated-gelu", buckets=cfg.relative_attention_num_buckets)
        groups = cfg.num_query_groups if cfg.num_query_groups not in (None, cfg.num_attention_heads) else 0
        return cls(**common, max_positions=cfg.max_position_embeddings or cfg.seq_length,
                   tied=cfg.tie_word_embeddings, gated=cfg.swiglu, query_groups=groups,
                   add_bias_linear=cfg.add_bias_linear, add_qkv_bias=cfg.add_qkv_bias, normalization=cfg.normalization,
                   position_embedding_type=cfg.position_embedding_type, rotary_percent=cfg.rotary_percent,
                   hidden_dropout=cfg.hidden_dropout, attention_dropout=cfg.attention_dropout,
                   qk_layernorm=cfg.qk_layernorm, qk_layernorm_full=cfg.qk_layernorm_full,
                   post_sublayer_norm=cfg.post_sublayer_norm)

    @classmethod
    def from_args(cls, args, vocab: int) -> "ModelShape":
        """From resolved arguments (`megatron.config.arguments.parse_args`, or a run's record)."""
        t5 = args.model_type == "t5"
        common = dict(model_type=args.model_type, num_layers=args.num_layers, hidden=args.hidden_size,
                      heads=args.num_attention_heads, kv_channels=args.kv_channels, ffn=args.ffn_hidden_size,
                      vocab=vocab, seq=args.encoder_seq_length if t5 else args.seq_length,
                      max_positions=args.max_position_embeddings, divisible_by=args.make_vocab_size_divisible_by,
                      tied=not bool(getattr(args, "untie_embeddings_and_output_weights", False)),
                      hidden_dropout=getattr(args, "hidden_dropout", 0.1),
                      attention_dropout=getattr(args, "attention_dropout", 0.1))
        if t5:
            return cls(**common, decoder_layers=args.decoder_num_layers, decoder_seq=args.decoder_seq_length,
                       gated=getattr(args, "feed_forward_proj", None) == "gated-gelu",
                       buckets=getattr(args, "relative_attention_num_buckets", None) or 32)
        return cls(**common, **gpt_layer_options(args))


def gpt_layer_options(args) -> dict:
    """ModelShape's GPT layer fields from Megatron's flags (resolved or not; absent flags: GPT-2's layer)."""
    flag = lambda name, default: default if getattr(args, name, None) is None else getattr(args, name)  # noqa: E731
    gqa = bool(flag("group_query_attention", False))
    return dict(gated=bool(flag("swiglu", False)), query_groups=(flag("num_query_groups", None) or 1) if gqa else 0,
                add_bias_linear=not flag("disable_bias_linear", False), add_qkv_bias=bool(flag("add_qkv_bias", False)),
                normalization=flag("normalization", "LayerNorm"),
                position_embedding_type=flag("position_embedding_type", "learned_absolute"),
                rotary_percent=flag("rotary_percent", 1.0), qk_layernorm=bool(flag("qk_layernorm", False)),
                qk_layernorm_full=bool(flag("qk_layernorm_full", False)),
                post_sublayer_norm=bool(flag("post_sublayer_norm", False)))


@dataclass(frozen=True)
class Spec:
    """One layer spec of the Pipe model: its kind and its parameters on one tp rank."""
    kind: str       # embed, layer, enc, dec, norm, head
    params: int
    first_of_stack: bool = False


def layer_specs(m: ModelShape, tp: int) -> List[Spec]:
    """The Pipe model's layer specs in order (gpt2_pipe.gpt2_layer_specs, t5_pipe.t5_layer_specs)."""
    if m.model_type == "gpt":
        return _gpt_specs(m, tp)
    h, w, f, V = m.hidden, m.width, m.ffn, m.padded_vocab(tp)
    f_in = 2 * f if m.gated else f
    enc = (4 * h * w + h * f_in + f * h) // tp + 2 * h
    dec = enc + 4 * h * w // tp + h
    bias = m.buckets * m.heads // tp
    specs = [Spec("embed", V * h // tp)]
    specs += [Spec("enc", enc + (bias if i == 0 else 0), i == 0) for i in range(m.num_layers)]
    specs += [Spec("norm", h)]
    specs += [Spec("dec", dec + (bias if i == 0 else 0), i == 0) for i in range(m.decoder_layers)]
    return specs + [Spec("norm", h), Spec("head", V * h // tp)]


def _gpt_specs(m: ModelShape, tp: int) -> List[Spec]:
    """GPT's specs (module docstring): embedding, L layers, final norm, the tied embedding again or an own head."""
    h, w, f, V = m.hidden, m.width, m.ffn, m.padded_vocab(tp)
    f_in = 2 * f if m.gated else f
    qkv = h * (w + 2 * m.kv_width) + (w + 2 * m.kv_width if m.qkv_bias else 0)
    mlp = h * f_in + f * h + (f_in if m.add_bias_linear else 0)
    norm = h if m.rms_norm else 2 * h
    layer = (qkv + w * h + mlp) // tp + 2 * norm + (2 * h if m.add_bias_linear else 0) + _qk_norm_params(m, tp)
    embed = V * h // tp + m.positions * h
    head = embed if m.tied else V * h // tp
    return [Spec("embed", embed), *[Spec("layer", layer) for _ in range(m.num_layers)], Spec("norm", norm),
            Spec("head", head)]


def _qk_norm_params(m: ModelShape, tp: int) -> int:
    """The query and key norms' weights on one tp rank: --qk-layernorm's two (d), replicated (LayerNorm: + biases);
    --qk-layernorm-full's (w) and (g), split with the heads."""
    if m.qk_layernorm:
        return 2 * m.kv_channels * (1 if m.rms_norm else 2)
    return (m.width + m.kv_width) // tp if m.qk_layernorm_full else 0


def _uniform(n: int, parts: int) -> List[int]:
    if n <= parts:
        return [min(p, n) for p in range(parts + 1)]
    size, extra = divmod(n, parts)
    bounds = [i * size for i in range(parts + 1)]
    for i in range(extra):
        bounds[i + 1:] = [b + 1 for b in bounds[i + 1:]]
    return bounds


@lru_cache(maxsize=None)
def _balanced(weights: Tuple[int, ...], parts: int) -> Tuple[int, ...]:
    """DeepSpeed's partition_balanced (the linear partition problem by dynamic programming), same tie-breaks."""
    n, inf = len(weights), float("inf")
    if n <= parts:
        return tuple(_uniform(n, parts))
    prefix = [0]
    for x in weights:
        prefix.append(prefix[-1] + x)
    dp_max = [[inf] * (parts + 1) for _ in range(n + 1)]
    dp_min = [[inf] * (parts + 1) for _ in range(n + 1)]
    cost = [[inf] * (parts + 1) for _ in range(n + 1)]
    pos = [[0] * (parts + 1) for _ in range(n + 1)]
    dp_max[0][0], cost[0][0] = 0, 0
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            for k in range(i):
                seg = prefix[i] - prefix[k]
                hi, lo = max(dp_max[k][j - 1], seg), min(dp_min[k][j - 1], seg)
                if cost[i][j] >= hi - lo:
                    cost[i][j], dp_max[i][j], dp_min[i][j], pos[i][j] = hi - lo, hi, lo, k
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(pos[bounds[-1]][j])
    return tuple(reversed(bounds))


def partition(specs: Sequence[Spec], parts: int, method="type:transformer") -> List[int]:
    """Spec boundaries of `parts` = pp x v chunks, as tds computes them."""
    if isinstance(method, (list, tuple)):
        return list(method)
    if method == "uniform":
        return _uniform(len(specs), parts)
    if method == "parameters":
        return list(_balanced(tuple(s.params for s in specs), parts))
    return list(_balanced(tuple(int(s.kind in ("layer", "enc", "dec")) for s in specs), parts))


def stage_chunks(bounds: Sequence[int], pp: int, v: int, stage: int) -> List[Tuple[int, int]]:
    """[start, stop) spec ranges of this stage's chunks c = 0..v-1 (part c*pp + stage)."""
    return [(bounds[c * pp + stage], bounds[c * pp + stage + 1]) for c in range(v)]
