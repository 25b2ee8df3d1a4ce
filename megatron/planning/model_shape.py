"""The model as the planner sees it: sizes, the Pipe model's layer specs with their parameters, the partition.

Shape legend: b micro-batch, s sequence (T5: s_e encoder, s_d decoder), h hidden, a heads, w = a x kv_channels
(attention width), f ffn hidden, V_p padded vocabulary, t tensor-parallel size.

Parameters per layer spec on one tensor-parallel rank (column/row-parallel matrices split by t, biases of
row-parallel outputs and norms replicated), exactly what `megatron.model` builds:

    GPT-2 embedding     V_p h / t + P h                       (word table vocab-parallel, positions replicated)
    GPT-2 layer         (3hw + 3w + wh + hf + f + fh) / t + 5h + 2h   (qkv, dense, mlp; 2 LayerNorms 4h; 2 biases h)
    GPT-2 final norm    2h;  LM head: the embedding again (TiedLayerSpec builds the whole module on the last stage)
    T5 embedding        V_p h / t;  untied head V_p h / t
    T5 encoder layer    (hw + 2hw + wh + h f_in + f h) / t + 2h   (f_in = 2f gated); first layer + buckets a / t
    T5 decoder layer    encoder layer + cross attention (4hw / t + h)
    T5 final norms      h each

The partition is tds's (`tds.pipe.module._parts`, DeepSpeed's `partition_balanced` over the transformer layers
for the default 'type:TransformerLayer'), re-implemented here without torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import List, Sequence, Tuple

__all__ = ["ModelShape", "Spec", "layer_specs", "partition", "stage_chunks"]


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
    gated: bool = False
    buckets: int = 32

    @property
    def width(self) -> int:
        return self.heads * self.kv_channels

    def padded_vocab(self, tp: int) -> int:
        multiple = self.divisible_by * tp
        return -(-self.vocab // multiple) * multiple

    @property
    def transformer_layers(self) -> int:
        return self.num_layers + self.decoder_layers

    @classmethod
    def from_config(cls, model_type: str, cfg, vocab: int) -> "ModelShape":
        """From a GPT2Config / T5Config (or anything with their fields) and the unpadded vocabulary."""
        common = dict(model_type=model_type, num_layers=cfg.num_layers, hidden=cfg.hidden_size,
                      heads=cfg.num_attention_heads, kv_channels=cfg.kv_channels or cfg.hidden_size //
                      cfg.num_attention_heads, ffn=cfg.ffn_hidden_size or 4 * cfg.hidden_size, vocab=vocab,
                      seq=cfg.seq_length, divisible_by=cfg.make_vocab_size_divisible_by)
        if model_type == "t5":
            return cls(**common, decoder_layers=cfg.num_decoder_layers or cfg.num_layers,
                       decoder_seq=cfg.decoder_seq_length or cfg.seq_length, tied=cfg.tie_word_embeddings,
                       gated=cfg.feed_forward_proj == "gated-gelu", buckets=cfg.relative_attention_num_buckets)
        return cls(**common, max_positions=cfg.max_position_embeddings or cfg.seq_length)

    @classmethod
    def from_args(cls, args, vocab: int) -> "ModelShape":
        """From resolved arguments (`megatron.config.arguments.parse_args`)."""
        t5 = args.model_type == "t5"
        return cls(model_type=args.model_type, num_layers=args.num_layers, hidden=args.hidden_size,
                   heads=args.num_attention_heads, kv_channels=args.kv_channels, ffn=args.ffn_hidden_size,
                   vocab=vocab, seq=args.encoder_seq_length if t5 else args.seq_length,
                   decoder_layers=args.decoder_num_layers if t5 else 0, decoder_seq=args.decoder_seq_length if t5
                   else 0, max_positions=args.max_position_embeddings, divisible_by=args.make_vocab_size_divisible_by,
                   tied=not bool(getattr(args, "untie_embeddings_and_output_weights", False)),
                   gated=getattr(args, "feed_forward_proj", None) == "gated-gelu",
                   buckets=getattr(args, "relative_attention_num_buckets", None) or 32)


@dataclass(frozen=True)
class Spec:
    """One layer spec of the Pipe model: its kind and its parameters on one tp rank."""
    kind: str       # embed, layer, enc, dec, norm, head
    params: int
    first_of_stack: bool = False


def layer_specs(m: ModelShape, tp: int) -> List[Spec]:
    """The Pipe model's layer specs in order (gpt2_pipe.gpt2_layer_specs, t5_pipe.t5_layer_specs)."""
    h, w, f, V = m.hidden, m.width, m.ffn, m.padded_vocab(tp)
    if m.model_type == "gpt":
        embed = V * h // tp + m.max_positions * h
        layer = (3 * h * w + 3 * w + w * h + h * f + f + f * h) // tp + 6 * h
        return [Spec("embed", embed), *[Spec("layer", layer) for _ in range(m.num_layers)], Spec("norm", 2 * h),
                Spec("head", embed)]
    f_in = 2 * f if m.gated else f
    enc = (4 * h * w + h * f_in + f * h) // tp + 2 * h
    dec = enc + 4 * h * w // tp + h
    bias = m.buckets * m.heads // tp
    specs = [Spec("embed", V * h // tp)]
    specs += [Spec("enc", enc + (bias if i == 0 else 0), i == 0) for i in range(m.num_layers)]
    specs += [Spec("norm", h)]
    specs += [Spec("dec", dec + (bias if i == 0 else 0), i == 0) for i in range(m.decoder_layers)]
    return specs + [Spec("norm", h), Spec("head", V * h // tp)]


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
