"""The T5 family: T5 v1.0 (ReLU feed-forward, tied head scaled by h^-0.5) and v1.1 (--feed-forward-proj gated-gelu
--untie-embeddings-and-output-weights), relative position bias, RMSNorm, no biases.

Micro-batches (b micro-batch, se / sd encoder / decoder sequence; masks True = masked out):
((enc_tokens, dec_tokens, enc_mask, dec_mask, cross_mask), (labels, loss_mask)): tokens/labels int64 (b, se) /
(b, sd); enc_mask (b, 1, se, se), dec_mask (b, 1, sd, sd) (causal), cross_mask (b, 1, sd, se).
Nothing here imports torch until a model, a dataset or a batch is made.
"""
from __future__ import annotations

import argparse
from typing import List, Optional

from megatron.errors import require
from .base import Location, ModelSpec, given
from .memory import STATS, ActivationOptions, LinearWidths, PipeLayer, head_bytes

T5_DEFAULTS = dict(feed_forward_proj="relu", untie_embeddings_and_output_weights=False,
                   relative_attention_num_buckets=32, relative_attention_max_distance=128)
OPTIONS = ("decoder_num_layers",) + tuple(k for k in T5_DEFAULTS if k != "untie_embeddings_and_output_weights")
KEYS = ("text_enc", "text_dec", "labels", "loss_mask", "enc_mask", "dec_mask", "enc_dec_mask")


class T5Spec(ModelSpec):
    model_type = "t5"
    entry_script = "pretrain_t5.py"
    pipe_layer_classes = ("T5EmbeddingPipe", "T5EncoderTransformerLayerPipe", "T5EncoderFinalNormPipe",
                          "T5DecoderTransformerLayerPipe", "T5DecoderFinalNormPipe", "T5LMHead")
    sequence_flags = ("encoder_seq_length", "decoder_seq_length")
    reference_vocab_size = 32128  # T5's SentencePiece model and its 100 sentinels, padded

    @property
    def config_class(self) -> type:
        from megatron.model.config import T5Config
        return T5Config

    # ---- configuration ---------------------------------------------------------------------------------------
    def default_ffn_size(self, args: argparse.Namespace) -> int:
        return 4 * args.hidden_size

    def resolve(self, args: argparse.Namespace) -> None:
        for name, value in T5_DEFAULTS.items():
            if getattr(args, name) is None:
                setattr(args, name, value)
        if args.decoder_num_layers is None:
            args.decoder_num_layers = args.num_layers
        require(args.decoder_num_layers >= 1, f"--decoder-num-layers must be >= 1, got {args.decoder_num_layers}")
        buckets, distance = args.relative_attention_num_buckets, args.relative_attention_max_distance
        require(buckets >= 4, f"--relative-attention-num-buckets must be >= 4, got {buckets}")
        require(distance > buckets // 2, f"--relative-attention-max-distance {distance} must exceed half of "
                                         f"--relative-attention-num-buckets {buckets}")

    def refuse_options(self, args: argparse.Namespace, script: str) -> None:
        stray = given(args, OPTIONS)
        require(not stray, f"{', '.join(stray)}: T5 options; {script} does not take them")

    def config(self, args):
        from megatron.model.config import T5Config
        from .common import dropout_fields, recompute_fields, speed_fields
        return T5Config(num_layers=args.num_layers, num_decoder_layers=args.decoder_num_layers,
                        hidden_size=args.hidden_size, num_attention_heads=args.num_attention_heads,
                        vocab_size=args.vocab_size, seq_length=args.encoder_seq_length,
                        decoder_seq_length=args.decoder_seq_length, ffn_hidden_size=args.ffn_hidden_size,
                        kv_channels=args.kv_channels, feed_forward_proj=args.feed_forward_proj,
                        tie_word_embeddings=not args.untie_embeddings_and_output_weights,
                        relative_attention_num_buckets=args.relative_attention_num_buckets,
                        relative_attention_max_distance=args.relative_attention_max_distance,
                        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                        layernorm_epsilon=args.layernorm_epsilon,
                        make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                        **recompute_fields(args), **speed_fields(args), **dropout_fields(args), seed=args.seed)

    # ---- building --------------------------------------------------------------------------------------------
    @property
    def plain(self) -> type:
        from megatron.model.t5_model import T5Model
        return T5Model

    def pipe(self, *args, **kwargs):
        from megatron.model.t5_pipe import T5ModelPipe
        return T5ModelPipe(*args, **kwargs)

    def pipe_layer_specs(self, config) -> list:
        from megatron.model.t5_pipe import t5_layer_specs
        return t5_layer_specs(config)

    def pipe_spec_count(self, args: argparse.Namespace) -> int:
        return args.num_layers + args.decoder_num_layers + 4  # embedding, encoder, norm, decoder, norm, head

    # ---- data ------------------------------------------------------------------------------------------------
    def datasets(self, data, tokenizer, num_samples: List[int]) -> list:
        from megatron.data.t5_dataset import build_t5_datasets
        return build_t5_datasets(data.data_path, data.split, num_samples, data.encoder_seq_length,
                                 data.decoder_seq_length, data.seed, tokenizer, noise_density=data.mask_prob)

    def get_batch(self, raw: Optional[dict], data, tokenizer, tp_group=None) -> tuple:
        import torch
        from megatron import mpu
        as_long = {key: raw[key].long() for key in KEYS} if raw is not None else None
        batch = mpu.broadcast_data(KEYS, as_long, torch.int64, tp_group)
        masks = [batch[key].bool().unsqueeze(1) for key in ("enc_mask", "dec_mask", "enc_dec_mask")]  # (b, 1, q, k)
        return (batch["text_enc"], batch["text_dec"], *masks), (batch["labels"], batch["loss_mask"].float())

    def synthetic_raw(self, b: int, data, vocab: int, gen) -> dict:
        """The seven keys of full-length documents."""
        import torch
        se, sd = data.encoder_seq_length, data.decoder_seq_length
        dec_mask = torch.ones(sd, sd, dtype=torch.long).triu(1)
        return {"text_enc": torch.randint(vocab, (b, se), generator=gen),
                "text_dec": torch.randint(vocab, (b, sd), generator=gen),
                "labels": torch.randint(vocab, (b, sd), generator=gen), "loss_mask": torch.ones(b, sd),
                "enc_mask": torch.zeros(b, se, se, dtype=torch.long), "dec_mask": dec_mask.expand(b, -1, -1),
                "enc_dec_mask": torch.zeros(b, sd, se, dtype=torch.long)}

    # ---- sizes -----------------------------------------------------------------------------------------------
    def transformer_layers(self, args) -> int:
        return args.num_layers + (args.decoder_num_layers or 0)

    def tokens_per_sample(self, data) -> int:
        return data.encoder_seq_length + data.decoder_seq_length

    def decoder_length(self, data) -> int:
        return data.decoder_seq_length

    def flops(self, config, global_batch_size: int, padded_vocab_size: int, recompute: Optional[bool] = None
              ) -> float:
        from megatron.model.flops import t5_flops_per_iteration
        recompute = config.checkpoint_num_layers > 0 if recompute is None else recompute
        return t5_flops_per_iteration(global_batch_size, config.seq_length, config.decoder_seq_length,
                                      config.num_layers, config.hidden_size,
                                      config.num_attention_heads * config.kv_channels, config.ffn_hidden_size,
                                      padded_vocab_size, recompute,
                                      num_decoder_layers=config.num_decoder_layers,
                                      gated=config.feed_forward_proj == "gated-gelu")

    def core_flops(self, config, global_batch_size: int) -> int:
        """4 B s_e^2 w per encoder layer, 4 B (s_d^2 + s_d s_e) w per decoder layer (self and cross attention)."""
        B, s_e, s_d = global_batch_size, config.seq_length, config.decoder_seq_length
        w = config.num_attention_heads * config.kv_channels
        enc = config.num_layers * 4 * B * s_e ** 2 * w
        return enc + config.num_decoder_layers * 4 * B * (s_d ** 2 + s_d * s_e) * w

    # ---- planner terms ---------------------------------------------------------------------------------------
    def pipe_layers(self, config, tp: int) -> List[PipeLayer]:
        """On one tp rank, w = a d, f_in = 2f with the gated GELU:

            embedding        V_p h / t;  untied head V_p h / t (tied: the embedding again)
            encoder layer    (hw + 2hw + wh + h f_in + f h) / t + 2h;  the first + buckets a / t (position bias)
            decoder layer    encoder layer + cross attention (4hw / t + h)
            final norms      h each
        """
        c = config
        h, w, f, V = c.hidden_size, c.num_attention_heads * c.kv_channels, c.ffn_hidden_size, c.padded_vocab_size(tp)
        f_in = 2 * f if c.feed_forward_proj == "gated-gelu" else f
        enc = (4 * h * w + h * f_in + f * h) // tp + 2 * h
        dec = enc + 4 * h * w // tp + h
        bias = c.relative_attention_num_buckets * c.num_attention_heads // tp
        tie = "word embeddings" if c.tie_word_embeddings else ""
        layers = [PipeLayer("embed", V * h // tp, tie=tie, lookup=True)]
        layers += [PipeLayer("enc", enc + (bias if i == 0 else 0), i == 0, True) for i in range(c.num_layers)]
        layers += [PipeLayer("norm", h)]
        layers += [PipeLayer("dec", dec + (bias if i == 0 else 0), i == 0, True) for i in range(c.num_decoder_layers)]
        return layers + [PipeLayer("norm", h), PipeLayer("head", V * h // tp, tie=tie)]

    def saved_bytes(self, layer: PipeLayer, config, o: ActivationOptions) -> float:
        """A T5 layer (RMSNorm saves input and normalised input; the inner dropout of the MLP keeps mask and
        output) saves 8 bsh e replicated, (4 bsw + 3 bsf) e / t split (gated: 6 bsf), 3 a b s^2 e / t of attention
        core and the bucket index (s^2 int64) -- RMSNorm computes in fp32, so its input and normalised input are
        kept at 4 bytes in bf16 too; a decoder layer adds cross attention: 4 b s_d h e replicated,
        (2 b s_d w + 2 b s_e w) e / t split and 3 a b s_d s_e e / t. The masks are counted at e bytes on CPU and GPU
        alike (no GPU measurement of T5 yet), and the core as SDPA's math path keeps it (these formulas assume
        dropout). Embedding: both stacks' tokens and dropped embeddings; final norms: input, output and dropout mask
        3 bsh e with stats, both sized by the encoder length (approximate); head: `memory.head_bytes`."""
        return _SAVED[layer.kind](config, o)

    def chunk_bytes(self, kinds, config, o: ActivationOptions) -> float:
        """The encoder output every decoder layer of the chunk attends to, b s_e h e, once per chunk."""
        return o.micro_batch * config.seq_length * config.hidden_size * o.element_bytes if "dec" in kinds else 0.0

    def core_mask_bytes(self, layer: PipeLayer, config, o: ActivationOptions) -> float:
        """a b s^2 x 4 over the layer's own length (self attention)."""
        s = _LENGTH[layer.kind](config)
        return config.num_attention_heads * o.micro_batch * s * s * 4 if o.tp > 1 else 0

    def linear_widths(self, config) -> LinearWidths:
        """Multi-head attention; the gated GELU's input projection counted one f wide (ZB-H1's T5 terms are not
        measured)."""
        w, f = config.num_attention_heads * config.kv_channels, config.ffn_hidden_size
        return LinearWidths(qkv=3 * w, dense=w, fc1=f, fc2=f)

    def boundary_tokens(self, config) -> int:
        """The encoder's and the decoder's hidden states cross every stage boundary."""
        return config.seq_length + config.decoder_seq_length

    def output_length(self, config) -> int:
        return config.decoder_seq_length

    # ---- checkpoints and tools -------------------------------------------------------------------------------
    def locations(self, config) -> Location:
        le, ld = config.num_layers, config.num_decoder_layers
        return [(r"embedding\.(.+)", lambda m: (0, m[1])),
                (r"encoder_layers\.(\d+)\.(.+)", lambda m: (1 + int(m[1]), m[2])),
                (r"encoder_final\.(.+)", lambda m: (le + 1, m[1])),
                (r"decoder_layers\.(\d+)\.(.+)", lambda m: (le + 2 + int(m[1]), m[2])),
                (r"decoder_final\.(.+)", lambda m: (le + ld + 2, m[1])),
                (r"lm_head\.(.+)", lambda m: (le + ld + 3, m[1]))]

    def example_script(self, args: dict) -> str:
        return "ds_pretrain_t5.sh"

    def completion(self, prompt: str, text: str) -> str:
        return f"input:  {prompt}\noutput: {text}"


# ---- saved activations (T5Spec.saved_bytes) --------------------------------------------------------------------
def _core_bytes(a: int, b: int, q: int, k: int, qkv_e: int, t: int, o: ActivationOptions) -> float:
    """The attention core's own saved bytes. Math path: probabilities, dropout mask, dropped probabilities
    (3 a b q k, none under selective recomputation). Fused kernels (flash / memory-efficient on a GPU): the
    log-sum-exp, selective or not (the core is not recomputed there); their output is laid out (b, q, a, d),
    so the head merge is a view of it and it is the context the output projection keeps (counted there)."""
    if o.attention == "fused":
        return a * b * q * 4 / t
    return 0 if o.recompute == "selective" else 3 * a * b * q * k * qkv_e / t


def _self_attention(s: int, c, o: ActivationOptions) -> float:
    b, h, w, f, a = o.micro_batch, c.hidden_size, c.num_attention_heads * c.kv_channels, c.ffn_hidden_size, \
        c.num_attention_heads
    e, t = o.element_bytes, o.tp
    qkv_e = 4 if o.attention == "math" else e  # CPU's math SDPA keeps fp32 copies of q, k, v in bf16
    # RMSNorm computes in fp32: input and normalised input kept at 4 bytes; outputs and masks at e
    replicated = 4 * b * s * h * 4 + 4 * b * s * h * e
    mlp = (6 if c.feed_forward_proj == "gated-gelu" else 3) * b * s * f
    # selective: the recomputed core keeps q, k, v as views of the qkv output (e bytes), not SDPA's copies
    qkv_saved = e if o.recompute == "selective" else qkv_e
    split = (3 * b * s * w * qkv_saved + (b * s * w + mlp) * e) / t
    core = _core_bytes(a, b, s, s, qkv_e, t, o)
    stats = 2 * b * s * STATS + 8 * s * s + (0 if e == 4 else 2 * 4 * h)
    if o.sequence_parallel:
        replicated /= t
    return replicated + split + core + stats


def _cross_attention(c, o: ActivationOptions) -> float:
    b, s_d, s_e, h = o.micro_batch, c.decoder_seq_length, c.seq_length, c.hidden_size
    w, a, e, t = c.num_attention_heads * c.kv_channels, c.num_attention_heads, o.element_bytes, o.tp
    qkv_e = 4 if o.attention == "math" else e
    qkv_saved = e if o.recompute == "selective" else qkv_e
    replicated = (2 * b * s_d * h * 4 + 2 * b * s_d * h * e) / (t if o.sequence_parallel else 1)
    split = ((b * s_d * w + 2 * b * s_e * w) * qkv_saved + b * s_d * w * e) / t  # q, k, v; context
    core = _core_bytes(a, b, s_d, s_e, qkv_e, t, o)
    return replicated + split + core + b * s_d * STATS + (0 if e == 4 else 4 * h)


def _saved_embed(c, o: ActivationOptions) -> float:
    b, s, h, e = o.micro_batch, c.seq_length + c.decoder_seq_length, c.hidden_size, o.element_bytes
    return 8 * b * s + b * s * h * e / (o.tp if o.sequence_parallel else 1)


def _saved_norm(c, o: ActivationOptions) -> float:
    b, s, h, e = o.micro_batch, c.seq_length, c.hidden_size, o.element_bytes
    return (3 * b * s * h * e + b * s * STATS) / (o.tp if o.sequence_parallel else 1)


_SAVED = {"embed": _saved_embed, "enc": lambda c, o: _self_attention(c.seq_length, c, o),
          "dec": lambda c, o: _self_attention(c.decoder_seq_length, c, o) + _cross_attention(c, o),
          "norm": _saved_norm, "head": lambda c, o: head_bytes(c.decoder_seq_length, c.padded_vocab_size(o.tp), o)}
_LENGTH = {"enc": lambda c: c.seq_length, "dec": lambda c: c.decoder_seq_length}
