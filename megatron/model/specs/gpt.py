"""The GPT family: GPT-2's layer by default, the layer of today's open models (Llama, Mistral, Qwen2, Qwen3, OLMo-2)
by options, as Megatron-LM names them (where it has a name):

    --position-embedding-type   learned_absolute (default) | rope | none
    --rotary-base / --rotary-percent / --use-rope-scaling (+ --rope-scaling-*)      rope only
    --normalization             LayerNorm (default) | RMSNorm; --norm-epsilon (= --layernorm-epsilon)
    --swiglu                    ffn default int(4h x 2/3 / 64) x 64 (Megatron's rule)
    --group-query-attention --num-query-groups G   (G default 1); heads % G == 0 and G % tp == 0
    --disable-bias-linear, --add-qkv-bias, --untie-embeddings-and-output-weights, --gelu tanh|erf
    --qk-layernorm              a norm (--normalization's) over each query / key head, before rotary (Qwen3)
    --qk-layernorm-full         instead, an RMSNorm over each token's whole query / key projection (OLMo-2)
    --post-sublayer-norm        the two norms on the attention / MLP outputs before the residual add (OLMo-2)

Every combination that cannot mean anything is a one-line UserError naming the flags and values (`resolve`).
Micro-batches (b micro-batch, s sequence): ((tokens, position_ids), (labels, loss_mask)), tokens/labels int64
(b, s), loss_mask float (b, s); with --reset-attention-mask ((tokens, position_ids, attention_mask), ...),
attention_mask bool (b, 1, s, s), True = masked (otherwise attention is causal by `is_causal`, no mask exists).
Nothing here imports torch until a model, a dataset or a batch is made.
"""
from __future__ import annotations

import argparse
from typing import List, Optional

from megatron.errors import require
from megatron.model.config import swiglu_ffn_size
from megatron.model.moe_config import OPTIONS as MOE_OPTIONS
from .base import Location, ModelSpec, given
from .memory import STATS, ActivationOptions, LinearWidths, PipeLayer, head_bytes, mask_bytes

ROPE_SCALING_DEFAULTS = dict(rope_scaling_factor=8.0, rope_scaling_low_freq_factor=1.0,
                             rope_scaling_high_freq_factor=4.0, rope_scaling_original_max_position_embeddings=8192)
ROPE_DEFAULTS = dict(rotary_base=10000.0, rotary_percent=1.0)
# The layer's switches that add or move parameters: one flag and one GPTConfig field of the same name each; the
# checkpoint tools read them from here (the fields a checkpoint must agree on, the flags import-hf prints).
LAYER_SWITCHES = {"qk_layernorm": "--qk-layernorm", "qk_layernorm_full": "--qk-layernorm-full",
                  "post_sublayer_norm": "--post-sublayer-norm"}
GPT_DEFAULTS = dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                    group_query_attention=False, disable_bias_linear=False, add_qkv_bias=False, use_rope_scaling=False,
                    **ROPE_DEFAULTS, **ROPE_SCALING_DEFAULTS, **dict.fromkeys(LAYER_SWITCHES, False))
OPTIONS = tuple(GPT_DEFAULTS) + ("num_query_groups",) + MOE_OPTIONS  # flags no other family takes


class GPTSpec(ModelSpec):
    model_type = "gpt"
    entry_script = "pretrain_gpt2.py"
    pipe_layer_classes = ("GPT2EmbeddingPipe", "GPT2TransformerLayerPipe", "GPT2FinalLayerNormPipe",
                          "GPT2LMHeadPipe")
    sequence_flags = ("seq_length",)
    zero_shot = True
    reference_vocab_size = 50257  # GPT-2's BPE

    @property
    def config_class(self) -> type:
        from megatron.model.config import GPTConfig
        return GPTConfig

    # ---- configuration ---------------------------------------------------------------------------------------
    def default_ffn_size(self, args: argparse.Namespace) -> int:
        """--ffn-hidden-size when not given: 4h, or Megatron's SwiGLU rule (0 for a hidden size under 24: refused)."""
        if not getattr(args, "swiglu", False):
            return 4 * args.hidden_size
        size = swiglu_ffn_size(args.hidden_size)
        require(size >= 1, f"--swiglu with --hidden-size {args.hidden_size}: the default --ffn-hidden-size "
                           f"int(4h x 2/3 / 64) x 64 is 0; give --ffn-hidden-size")
        return size

    def resolve(self, args: argparse.Namespace) -> None:
        args.untie_embeddings_and_output_weights = bool(args.untie_embeddings_and_output_weights)
        rope = args.position_embedding_type == "rope"
        if not rope:
            stray = given(args, tuple(ROPE_DEFAULTS) + ("use_rope_scaling",) + tuple(ROPE_SCALING_DEFAULTS))
            require(not stray, f"{', '.join(stray)} apply to --position-embedding-type rope, not "
                               f"{args.position_embedding_type or 'learned_absolute'}")
        if not args.use_rope_scaling:
            stray = given(args, ROPE_SCALING_DEFAULTS)
            require(not stray, f"{', '.join(stray)} need --use-rope-scaling")
        groups = args.num_query_groups
        require(groups is None or args.group_query_attention,
                f"--num-query-groups {groups} needs --group-query-attention")
        for name, value in GPT_DEFAULTS.items():
            if getattr(args, name, None) is None:
                setattr(args, name, value)
        heads, tp = args.num_attention_heads, args.tensor_model_parallel_size
        if args.group_query_attention:
            groups = args.num_query_groups = 1 if groups is None else groups
            require(1 <= groups <= heads and heads % groups == 0,
                    f"--num-query-groups {groups} must divide --num-attention-heads {heads}")
            require(groups % tp == 0, f"--num-query-groups {groups} is not divisible by --tensor-model-parallel-size "
                                      f"{tp}: each tensor-parallel rank holds whole key/value groups")
        _resolve_rope(args)
        require(not (args.qk_layernorm and args.qk_layernorm_full),
                "--qk-layernorm (a norm over each head, Qwen3's) and --qk-layernorm-full (one over the whole "
                "projection, OLMo-2's) exclude each other; give one")
        require(not args.qk_layernorm_full or args.normalization == "RMSNorm",
                f"--qk-layernorm-full is OLMo-2's RMSNorm over the whole query / key projection, but --normalization "
                f"is {args.normalization}; give --normalization RMSNorm (or --qk-layernorm: a {args.normalization} "
                f"over each head)")
        if args.reset_position_ids:
            require(args.position_embedding_type == "learned_absolute",
                    f"--reset-position-ids restarts the learned position table at each document, but "
                    f"--position-embedding-type is {args.position_embedding_type} (rotary positions run 0 .. s-1 over "
                    f"each sequence); drop --reset-position-ids (--reset-attention-mask keeps documents apart)")

    def refuse_options(self, args: argparse.Namespace, script: str) -> None:
        stray = given(args, OPTIONS)
        require(not stray, f"{', '.join(stray)}: GPT options; {script} does not take them")

    def config(self, args):
        from megatron.model.config import GPTConfig
        from megatron.model.moe_config import moe_config_from_args
        from .common import dropout_fields, recompute_fields, speed_fields
        groups = args.num_query_groups if getattr(args, "group_query_attention", False) else None
        scaling = getattr(args, "use_rope_scaling", False)
        return GPTConfig(num_layers=args.num_layers, hidden_size=args.hidden_size,
                         num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size,
                         seq_length=args.seq_length, ffn_hidden_size=args.ffn_hidden_size, kv_channels=args.kv_channels,
                         hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
                         layernorm_epsilon=args.layernorm_epsilon,
                         make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
                         **recompute_fields(args), **speed_fields(args), **dropout_fields(args), seed=args.seed,
                         max_position_embeddings=args.max_position_embeddings,
                         init_method_std=args.init_method_std,
                         explicit_attention_mask=bool(getattr(args, "reset_attention_mask", False)),
                         position_embedding_type=getattr(args, "position_embedding_type", None) or "learned_absolute",
                         rotary_base=getattr(args, "rotary_base", None) or 10000.0,
                         rotary_percent=getattr(args, "rotary_percent", None) or 1.0,
                         rope_scaling_factor=args.rope_scaling_factor if scaling else None,
                         rope_low_freq_factor=getattr(args, "rope_scaling_low_freq_factor", None) or 1.0,
                         rope_high_freq_factor=getattr(args, "rope_scaling_high_freq_factor", None) or 4.0,
                         rope_original_max_positions=getattr(args, "rope_scaling_original_max_position_embeddings",
                                                             None) or 8192,
                         normalization=getattr(args, "normalization", None) or "LayerNorm",
                         swiglu=bool(getattr(args, "swiglu", False)), num_query_groups=groups,
                         add_bias_linear=not getattr(args, "disable_bias_linear", False),
                         add_qkv_bias=bool(getattr(args, "add_qkv_bias", False)),
                         tie_word_embeddings=not getattr(args, "untie_embeddings_and_output_weights", False),
                         gelu=getattr(args, "gelu", None) or "tanh",
                         **{name: bool(getattr(args, name, False)) for name in LAYER_SWITCHES},
                         moe=moe_config_from_args(args))

    # ---- building --------------------------------------------------------------------------------------------
    @property
    def plain(self) -> type:
        from megatron.model.gpt2_model import GPTModel
        return GPTModel

    def pipe(self, *args, **kwargs):
        from megatron.model.gpt2_pipe import GPTModelPipe  # imports tds.pipe, which plain-model users need not load
        return GPTModelPipe(*args, **kwargs)

    def pipe_layer_specs(self, config) -> list:
        from megatron.model.gpt2_pipe import gpt2_layer_specs
        return gpt2_layer_specs(config)

    def pipe_spec_count(self, args: argparse.Namespace) -> int:
        return args.num_layers + 3  # embedding, layers, final norm, tied or own head

    # ---- data ------------------------------------------------------------------------------------------------
    def datasets(self, data, tokenizer, num_samples: List[int]) -> list:
        from megatron.data.gpt_dataset import build_train_valid_test_datasets
        from megatron.data.token_ids import vocabulary_limit
        return build_train_valid_test_datasets(data.data_path, data.split, num_samples, data.seq_length, data.seed,
                                               token_limit=vocabulary_limit(tokenizer))

    def get_batch(self, raw: Optional[dict], data, tokenizer, tp_group=None) -> tuple:
        import torch
        from megatron import mpu
        from megatron.data.masks import get_ltor_masks_and_position_ids
        text = mpu.broadcast_data(["text"], raw, torch.int64, tp_group)["text"]  # (b, s + 1)
        tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
        attention_mask, loss_mask, position_ids = get_ltor_masks_and_position_ids(
            tokens, tokenizer.eod, data.reset_position_ids, data.reset_attention_mask, data.eod_mask_loss)
        inputs = (tokens, position_ids) if attention_mask is None else (tokens, position_ids, attention_mask)
        return inputs, (labels, loss_mask)

    def synthetic_raw(self, b: int, data, vocab: int, gen) -> dict:
        """'text' (b, s + 1) of random ids, never the end-of-document id 0."""
        import torch
        return {"text": torch.randint(1, vocab, (b, data.seq_length + 1), generator=gen)}

    # ---- sizes -----------------------------------------------------------------------------------------------
    def transformer_layers(self, args) -> int:
        return args.num_layers

    def tokens_per_sample(self, data) -> int:
        return data.seq_length

    def decoder_length(self, data) -> int:
        return data.seq_length

    def flops(self, config, global_batch_size: int, padded_vocab_size: int, recompute: Optional[bool] = None
              ) -> float:
        from megatron.model.flops import gpt_flops_per_iteration
        recompute = config.checkpoint_num_layers > 0 if recompute is None else recompute
        return gpt_flops_per_iteration(global_batch_size, config.seq_length, config.num_layers, config.hidden_size,
                                       config.num_attention_heads * config.kv_channels, config.ffn_hidden_size,
                                       padded_vocab_size, recompute,
                                       d_kv=config.num_query_groups * config.kv_channels, gated=config.swiglu)

    def core_flops(self, config, global_batch_size: int) -> int:
        """4 B s^2 w per layer: QK^T and the weighted values."""
        w = config.num_attention_heads * config.kv_channels
        return config.num_layers * 4 * global_batch_size * config.seq_length ** 2 * w

    # ---- planner terms ---------------------------------------------------------------------------------------
    def pipe_layers(self, config, tp: int) -> List[PipeLayer]:
        """Embedding, L layers, final norm, the tied embedding again or an own head; on one tp rank (column / row
        parallel matrices split by t, row-parallel biases and norms replicated), w = a d, g = G d, f_in = 2f with
        SwiGLU:

            embedding   V_p h / t  (+ P h replicated with learned positions; none with rope / none)
            layer       (h (w + 2g) [+ (w + 2g) qkv bias] + wh + h f_in + f h [+ f_in]) / t
                        + 2 norms (LayerNorm 2h, RMSNorm h) [+ 2h: the dense and fc2 biases]
                        biases [..] with add_bias_linear; the qkv bias also with add_qkv_bias
                        + 2 query / key norms of d each (LayerNorm 2d) with --qk-layernorm, replicated, or
                        (w + g) / t with --qk-layernorm-full (split with the heads); --post-sublayer-norm moves the
                        2 norms, the same parameters
                        GPT-2 (g = w, f_in = f, biases, LayerNorm): (3hw + 3w + wh + hf + f + fh) / t + 6h
            final norm  2h (LayerNorm) or h (RMSNorm)
            LM head     tied: the embedding again (TiedLayerSpec builds the whole module on the last stage);
                        untied: its own V_p h / t
        """
        c = config
        h, w, f, V = c.hidden_size, c.num_attention_heads * c.kv_channels, c.ffn_hidden_size, c.padded_vocab_size(tp)
        g = c.num_query_groups * c.kv_channels
        f_in = 2 * f if c.swiglu else f
        qkv = h * (w + 2 * g) + (w + 2 * g if c.qkv_bias else 0)
        mlp = h * f_in + f * h + (f_in if c.add_bias_linear else 0)
        norm = h if c.normalization == "RMSNorm" else 2 * h
        layer = (qkv + w * h + mlp) // tp + 2 * norm + (2 * h if c.add_bias_linear else 0) + _qk_norm_params(c, tp)
        positions = c.max_position_embeddings if c.position_embedding_type == "learned_absolute" else 0
        embed = V * h // tp + positions * h
        tie = "word embeddings" if c.tie_word_embeddings else ""
        head = PipeLayer("head", embed, tie=tie) if tie else PipeLayer("head", V * h // tp)
        return [PipeLayer("embed", embed, tie=tie, lookup=True),
                *[PipeLayer("layer", layer, transformer=True)] * c.num_layers,
                PipeLayer("norm", norm), head]

    def saved_bytes(self, layer: PipeLayer, config, o: ActivationOptions) -> float:
        """What one micro-batch leaves saved for backward, per layer spec (`_saved_layer` for the layers; embedding:
        tokens and positions int64, no positions with rope / none, and the embedding dropout mask b s h (none
        without hidden dropout); final norm: LayerNorm's input and output 2 b s h e and stats, RMSNorm's fp32
        input and normalised input, its output, rstd and in bf16 its fp32 weight, (8 + e) b s h + 4 b s (+ 4h);
        head: `memory.head_bytes`)."""
        return _SAVED[layer.kind](config, o)

    def core_mask_bytes(self, layer: PipeLayer, config, o: ActivationOptions) -> float:
        """a b s^2 x 4 (attention_core's fp32 mask); none without attention dropout (CPU's flash kernel)."""
        dropout = config.attention_dropout > 0
        s = config.seq_length
        return config.num_attention_heads * o.micro_batch * s * s * 4 if o.tp > 1 and dropout else 0

    def layer_cache_bytes(self, config, element_bytes: int) -> int:
        """Rotary positions: each layer's RotaryEmbedding caches cos and sin (s, r) in the activations' dtype from
        its first forward on (megatron.model.position)."""
        rotary = config.rotary_dim() if config.position_embedding_type == "rope" else 0
        return 2 * config.seq_length * rotary * element_bytes

    def linear_widths(self, config) -> LinearWidths:
        w, g = config.num_attention_heads * config.kv_channels, config.num_query_groups * config.kv_channels
        f = config.ffn_hidden_size
        return LinearWidths(qkv=w + 2 * g, dense=w, fc1=2 * f if config.swiglu else f, fc2=f)

    def boundary_tokens(self, config) -> int:
        return config.seq_length

    def output_length(self, config) -> int:
        return config.seq_length

    def tensor_parallel_sizes(self, config) -> tuple:
        return config.num_attention_heads, config.num_query_groups, config.ffn_hidden_size

    # ---- checkpoints and tools -------------------------------------------------------------------------------
    def locations(self, config) -> Location:
        n = config.num_layers
        return [(r"embedding\.(.+)", lambda m: (0, m[1])),
                (r"layers\.(\d+)\.(.+)", lambda m: (1 + int(m[1]), m[2])),
                (r"(final_layernorm\..+)", lambda m: (n + 1, m[1])),
                (r"lm_head\.(.+)", lambda m: (n + 2, m[1]))]

    def example_script(self, args: dict) -> str:
        llama = args.get("swiglu") or args.get("position_embedding_type") == "rope"
        return "ds_pretrain_llama.sh" if llama else "ds_pretrain_gpt2.sh"

    def completion(self, prompt: str, text: str) -> str:
        return prompt + text


def _qk_norm_params(c, tp: int) -> int:
    """The query and key norms' weights on one tp rank: --qk-layernorm's two (d), replicated (LayerNorm: + biases);
    --qk-layernorm-full's (w) and (g), split with the heads."""
    if c.qk_layernorm:
        return 2 * c.kv_channels * (1 if c.normalization == "RMSNorm" else 2)
    w, g = c.num_attention_heads * c.kv_channels, c.num_query_groups * c.kv_channels
    return (w + g) // tp if c.qk_layernorm_full else 0


def _resolve_rope(args: argparse.Namespace) -> None:
    if args.position_embedding_type != "rope":
        return
    percent, d = args.rotary_percent, args.kv_channels
    rotated = d * percent
    require(0.0 < percent <= 1.0 and rotated == int(rotated) and int(rotated) % 2 == 0,
            f"--rotary-percent {percent} of --kv-channels {d} must leave an even number of rotated channels "
            f"(got {rotated:g})")
    require(args.rotary_base > 0, f"--rotary-base must be > 0, got {args.rotary_base}")
    if args.use_rope_scaling:
        low, high = args.rope_scaling_low_freq_factor, args.rope_scaling_high_freq_factor
        require(args.rope_scaling_factor > 0 and 0 < low < high,
                f"--rope-scaling-factor {args.rope_scaling_factor} must be > 0 and --rope-scaling-low-freq-factor "
                f"{low} < --rope-scaling-high-freq-factor {high}, both > 0")
        require(args.rope_scaling_original_max_position_embeddings >= 1,
                f"--rope-scaling-original-max-position-embeddings must be >= 1, got "
                f"{args.rope_scaling_original_max_position_embeddings}")


# ---- the layer's saved activations (GPTSpec.saved_bytes) -------------------------------------------------------
def _saved_layer(c, o: ActivationOptions) -> float:
    """One GPT layer, b s positions. GPT-2's layer saves

        replicated over tp   its input, LN1 out, LN2 in, LN2 out, 2 dropout masks  6 bsh e    (+ 4 LN stats 4bs x 4 B)
        split over tp        q, k, v, context 4 bsw e; MLP in and GELU out 2 bsf e  / t
        attention core       softmax, dropout mask, dropped probabilities        3 a b s^2 e / t

    which is Korthikanti et al. (2022)'s sbh(10 + 24/t + 5as/(ht)) with SDPA's math path on CPU and this code's
    dtype for the dropout masks (`memory.mask_bytes`). LayerNorm's mean and rstd are fp32 on CUDA, the input's
    dtype on CPU. The Llama family's options change these terms:

        RMSNorm           each norm keeps its input in fp32 and the normalised input (fp32), 8 bsh, its output
                          e bsh (the next GEMM's input), its rstd 4 bs and, in bf16, the fp32 copy of its weight
                          4h: 2 (8 + e) bsh replicated instead of LayerNorm's 4 bsh e
        SwiGLU            the fused input projection's output (gate and up, 2f), silu(gate) and the product
                          (fc2's input): 4 bsf e / t instead of GELU's 2 bsf e / t
        biases            none kept (a linear keeps its input and weight, with or without a bias)
        hidden dropout 0  no masks (SeededDropout is the identity)
        attention         `_saved_attention` (with the query / key norms: `_qk_norm_bytes`)
        post-sublayer norms  --post-sublayer-norm keeps the same bytes (measured): a norm's output now goes to
                          the dropout and the residual add, which keep nothing of it, and the GEMM it fed keeps
                          the residual stream instead, of the same size

    Sequence parallelism (Korthikanti §4.2.2) divides the replicated part by t as well."""
    b, s, h, f, e, t = o.micro_batch, c.seq_length, c.hidden_size, c.ffn_hidden_size, o.element_bytes, o.tp
    sp = t if o.sequence_parallel else 1
    if c.normalization == "RMSNorm":  # fp32 input and normalised input, output at e; rstd fp32, bf16: fp32 weight
        norms, stats = 2 * (8 + e) * b * s * h, 2 * b * s * STATS / sp + (0 if e == 4 else 2 * 4 * h)
    else:  # 2 LayerNorm inputs (no fp32 copies: torch's kernels accumulate in fp32), their outputs
        # LayerNorm's mean and rstd: fp32 on CUDA, the input's dtype on CPU (`attention="math"` stands for CPU)
        norms, stats = 4 * b * s * h * e, 4 * b * s * (STATS if o.attention == "fused" else e)
    masks = 2 * b * s * h * mask_bytes(o) if c.hidden_dropout > 0 else 0
    attention, core = _saved_attention(b, s, c, o)
    split = (attention + (4 if c.swiglu else 2) * b * s * f * e) / t  # SwiGLU: gate and up, silu(gate), product
    return (norms + masks) / sp + split + core + stats


def _saved_attention(b: int, s: int, c, o: ActivationOptions) -> tuple:
    """(bytes split over tp before the division by t, attention core bytes on this rank) of GPT's attention.

    CPU with attention dropout (`attention_core`'s explicit form): q, k, v in fp32 with k, v repeated to a heads, so
    grouped-query attention keeps what multi-head attention keeps: 3 bsw x 4 B + context bsw e, and 3 a b s^2 x 4 B
    of core. A flash kernel -- CPU's SDPA without attention dropout, a GPU's flash / memory-efficient kernels (their
    output, laid out (b, s, a, d), is the context itself after the head merge, a view: measured on an H100) --
    keeps q, k, v as they enter (k, v with G heads: enable_gqa repeats nothing), its output and the log-sum-exp
    a b s 4, no s^2 tensor. q, k, v enter as views of the fused QKV output, b s (w + 2g) e, which stays alive whole;
    rotary positions add the rotated q and k, b s (w + g) e (the rotation keeps only its cos / sin tables). For
    GPT-2's layer (g = w, no rotary) these flash terms are 4 bsw e + a b s 4. Selective recomputation keeps the
    core's inputs as they enter and the context bsw e; the log-sum-exp too on a GPU (SDPA's fused kernels are not
    recomputed), none on CPU. With micro-batch 1 SDPA keeps v as a view of the fused qkv output, so its storage
    (3 bsw) stays alive: the formulas assume b >= 2."""
    a, e, t = c.num_attention_heads, o.element_bytes, o.tp
    w, g = a * c.kv_channels, c.num_query_groups * c.kv_channels
    context = b * s * w * e  # the output projection's input
    qk_norm = c.qk_layernorm or c.qk_layernorm_full
    # q, k, v as they enter the core: views of the fused QKV output (b, s, w + 2g), and the rotated (or
    # normalised) q and k, tensors of their own
    own_qk = (c.position_embedding_type == "rope" and c.rotary_dim()) or qk_norm
    entering = (b * s * (w + 2 * g) + (b * s * (w + g) if own_qk else 0)) * e
    norms = _qk_norm_bytes(b, s, c, o)
    flash = o.attention == "fused" or c.attention_dropout == 0  # no s^2 tensors (CPU: SDPA's flash kernel)
    recomputed = o.recompute == "selective" and o.attention == "math"  # CPU recomputes even a flash core
    if flash:
        return entering + context + norms, 0 if recomputed else a * b * s * STATS / t  # + the log-sum-exp
    if o.recompute == "selective":
        return entering + context + norms, 0
    # the explicit form with dropout: q and k, v repeated to a heads, in fp32, of their own (the batched matmuls
    # keep contiguous copies of the head-split views); a query / key norm keeps the fused QKV output as its input
    # besides (RMSNorm in fp32 only: in bf16 its own fp32 copy, counted with the norm); probabilities, mask, dropped
    kept = qk_norm and (e == 4 or c.normalization != "RMSNorm")
    explicit = 3 * b * s * w * 4 + (b * s * (w + 2 * g) * e if kept else 0)
    return explicit + context + norms, 3 * a * b * s * s * 4 / t


def _qk_norm_bytes(b: int, s: int, c, o: ActivationOptions) -> float:
    """What the query / key norms keep besides their input, before the division by t (split like the heads).

    --qk-layernorm's RMSNorm keeps its input in fp32 (in fp32 the fused QKV output itself, in bf16 a copy,
    b s (w + g) 4), the normalised input b s (w + g) 4, its rstd b (a + G) s 4 and in bf16 its weights in fp32
    (2 d 4 on every rank, counted as if split too: a few bytes); as LayerNorm its input (the QKV output) and its
    mean and rstd (2 b (a + G) s, in fp32 on CUDA, in the input's dtype on CPU). --qk-layernorm-full's RMSNorm over
    all heads keeps what RMSNorm keeps, its rstd (b, s) once per norm on every rank (2 b s 4) and in bf16 its
    weights' fp32 copy (w + g) 4 / t. The normalised q and k enter the core as the rotated ones do
    (`_saved_attention`), laid out like the projection's output (so the core's output is still the context)."""
    if not (c.qk_layernorm or c.qk_layernorm_full):
        return 0
    a, G, d, e, t = c.num_attention_heads, c.num_query_groups, c.kv_channels, o.element_bytes, o.tp
    rows, heads = b * s * (a + G) * d, b * s * (a + G)
    if c.normalization != "RMSNorm":  # --qk-layernorm as LayerNorm: mean and rstd
        return 2 * heads * (STATS if o.attention == "fused" else e)
    weights = 2 * d * t if c.qk_layernorm else (a + G) * d
    rstd = heads * STATS if c.qk_layernorm else 2 * b * s * STATS * t
    return rows * 4 + rstd + (0 if e == 4 else rows * 4 + weights * 4)


def _saved_embed(c, o: ActivationOptions) -> float:
    b, s, h = o.micro_batch, c.seq_length, c.hidden_size
    sp = o.tp if o.sequence_parallel else 1  # sequence parallelism splits the hidden states outside the GEMMs
    positions = 8 * s if c.position_embedding_type == "learned_absolute" and c.max_position_embeddings else 0
    mask = b * s * h * mask_bytes(o) / sp if c.hidden_dropout > 0 else 0
    return 8 * b * s + positions + mask


def _saved_norm(c, o: ActivationOptions) -> float:
    b, s, h, e = o.micro_batch, c.seq_length, c.hidden_size, o.element_bytes
    sp = o.tp if o.sequence_parallel else 1
    if c.normalization == "RMSNorm":
        return ((8 + e) * b * s * h + b * s * STATS) / sp + (0 if e == 4 else 4 * h)
    return (2 * b * s * h * e + b * s * STATS) / sp


def _saved_head(c, o: ActivationOptions) -> float:
    return head_bytes(c.seq_length, c.padded_vocab_size(o.tp), o)


_SAVED = {"embed": _saved_embed, "layer": _saved_layer, "norm": _saved_norm, "head": _saved_head}
