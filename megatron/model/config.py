"""Model hyper-parameters: small torch-free dataclasses that the model's spec builds from resolved arguments
(`megatron.model.specs`; model code never reads args), validated once in `__post_init__`.

    GPTConfig   decoder-only GPT: GPT-2 by default (learned positions, pre-LayerNorm, GELU-tanh, biases, tied LM
                head), and the Llama-family layer by its options (rotary positions, RMSNorm, SwiGLU, grouped-query
                attention, no biases, untied head, query / key norms); `GPT2Config` is its earlier name
    T5Config    encoder-decoder T5 v1.0 / v1.1 (relative position bias, RMSNorm, no biases)

The parameters' dtype is a name (`params_dtype`, 'float32'), the torch dtype `config.dtype` resolved when modules
are built, so that the preflight and the planner read configurations without importing torch.

Derived sizes are filled in `__post_init__` (ffn 4h for GPT-2, `swiglu_ffn_size(h)` with SwiGLU, kv channels
h / heads, query groups = heads); the padded
vocabulary depends on the tensor-parallel size, so it is a function, `padded_vocab_size`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from .moe_config import MoEConfig


def padded_vocab_size(vocab_size: int, divisible_by: int = 128, tp: int = 1) -> int:
    """Megatron's padding: the smallest multiple of divisible_by * tp that holds vocab_size.

    Every tensor-parallel rank then holds V_pad / tp rows, a multiple of `divisible_by` (GEMM-friendly).
    Padded ids are never predicted: their logits are set to the dtype's minimum (see `language_model`).
    """
    if vocab_size < 1 or divisible_by < 1 or tp < 1:
        raise ValueError(f"padded_vocab_size needs positive sizes, got vocab_size={vocab_size}, "
                         f"divisible_by={divisible_by}, tp={tp}")
    multiple = divisible_by * tp
    return -(-vocab_size // multiple) * multiple


POSITION_EMBEDDING_TYPES = ("learned_absolute", "rope", "none")
NORMALIZATIONS = ("LayerNorm", "RMSNorm")
GELUS = ("tanh", "erf")


def swiglu_ffn_size(hidden_size: int) -> int:
    """Megatron's default ffn width with --swiglu: 2/3 of 4h (two input projections keep the parameter count of a
    4h GELU MLP), rounded down to a multiple of 64."""
    return int((4 * hidden_size * 2 / 3) / 64) * 64


@dataclass
class TransformerConfig:
    """Fields shared by GPT-2 and T5.

    seed: base seed of weight initialisation (module k is built under seed + k, see `rng.init_rng`) and of
        dropout (see `rng.SeededDropout`).
    Recomputation (Megatron's --recompute-*; `transformer` and `attention` apply it):
    checkpoint_num_layers: N > 0 recomputes whole layers in backward (granularity 'full'); 0 = no full
        recomputation. recompute_method 'uniform': every run of N layers keeps only its input; 'block': the
        first N transformer layers of each pipeline stage (each model chunk) keep only their inputs, the
        others keep everything.
    recompute_granularity: None, 'full' (implied by checkpoint_num_layers > 0) or 'selective': recompute only
        the attention core (softmax(Q K^T) V with its dropout), whose stored scores/probabilities grow with s^2;
        a no-op in memory wherever scaled_dot_product_attention runs a fused kernel, which stores none.
    kv_channels: per-head width of queries/keys/values; hidden_size // num_attention_heads by default.
    Speed (the same numbers either way; not part of a checkpoint's model record):
    cross_entropy_loss_fusion: the loss's vocab-parallel cross entropy in its fused form (`mpu.cross_entropy`).
    compile_layers: torch.compile each transformer layer of the Pipe model (`megatron.model.compile`).
    explicit_attention: attention with dropout in its explicit form on every device, not SDPA's fused kernels,
        which draw their own masks (--layout-invariant; on CPU it is the explicit form anyway).
    keyed_dropout: every dropout mask keyed by sample and position (`rng.SeededDropout.keyed`, --keyed-dropout).
    """
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    vocab_size: int
    seq_length: int
    ffn_hidden_size: Optional[int] = None
    kv_channels: Optional[int] = None
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    layernorm_epsilon: float = 1e-5
    make_vocab_size_divisible_by: int = 128
    params_dtype: str = "float32"
    checkpoint_num_layers: int = 0
    seed: int = 1234
    recompute_granularity: Optional[str] = None
    recompute_method: str = "uniform"
    cross_entropy_loss_fusion: bool = False
    compile_layers: bool = False
    explicit_attention: bool = False
    keyed_dropout: bool = False

    def __post_init__(self):
        if not isinstance(self.params_dtype, str):  # a torch dtype given: kept by its name
            self.params_dtype = str(self.params_dtype).replace("torch.", "")
        for name in ("num_layers", "hidden_size", "num_attention_heads", "vocab_size", "seq_length"):
            if getattr(self, name) < 1:
                raise ValueError(f"{type(self).__name__}.{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                                 f"({self.num_attention_heads}); set kv_channels explicitly")
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.checkpoint_num_layers < 0:
            raise ValueError(f"checkpoint_num_layers must be >= 0, got {self.checkpoint_num_layers}")
        if self.recompute_granularity is None and self.checkpoint_num_layers > 0:
            self.recompute_granularity = "full"
        if self.recompute_granularity not in (None, "full", "selective"):
            raise ValueError(f"recompute_granularity must be None, 'full' or 'selective', "
                             f"got {self.recompute_granularity!r}")
        if (self.recompute_granularity == "full") != (self.checkpoint_num_layers > 0):
            raise ValueError(f"recompute_granularity {self.recompute_granularity!r} with checkpoint_num_layers "
                             f"{self.checkpoint_num_layers}: full recomputation needs checkpoint_num_layers > 0, "
                             f"and only full recomputation uses it")
        if self.recompute_method not in ("uniform", "block"):
            raise ValueError(f"recompute_method must be 'uniform' or 'block', got {self.recompute_method!r}")

    def padded_vocab_size(self, tp: int) -> int:
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    @property
    def dtype(self) -> Any:
        """The parameters' torch dtype (torch imported here, when modules are built)."""
        import torch
        return getattr(torch, self.params_dtype)


@dataclass
class GPTConfig(TransformerConfig):
    """GPT. max_position_embeddings defaults to seq_length; init std 0.02, output layers 0.02/sqrt(2L).

    explicit_attention_mask: the micro-batches carry a bool attention mask (b, 1, s, s) (Megatron's
        --reset-attention-mask: documents attend within themselves), and it crosses the pipeline stages. False
        (the default data): attention is plain causal, run as scaled_dot_product_attention(is_causal=True) with
        no mask tensor anywhere, which admits the flash kernel on GPUs.

    The layer of today's open models (Llama, Mistral, Qwen2, Qwen3, OLMo-2), Megatron-LM's flags in brackets:
    position_embedding_type: 'learned_absolute' (GPT-2's table), 'rope' (rotary, applied to queries and keys in
        every layer; no table) or 'none'. rotary_base (--rotary-base), rotary_percent: the fraction of each head's
        width that rotates (--rotary-percent). rope_scaling_factor: Llama 3.1's frequency scaling ('llama3',
        --use-rope-scaling) with rope_low_freq_factor, rope_high_freq_factor and rope_original_max_positions;
        None = none.
    normalization: 'LayerNorm' or 'RMSNorm' (no mean, no bias); layernorm_epsilon is its epsilon (--norm-epsilon).
    swiglu: MLP silu(x W_gate) * (x W_up) W_down, the two input projections fused as one stride-2 GEMM.
    num_query_groups: G key/value heads shared by heads / G query heads each (grouped-query attention); None = one
        per head (multi-head attention).
    add_bias_linear: biases on every linear layer (GPT-2); add_qkv_bias: a bias on the QKV projection even
        without them (Qwen2).
    tie_word_embeddings: the LM head is the word table (GPT-2); False: an own vocab-parallel output weight
        (--untie-embeddings-and-output-weights).
    gelu: the MLP's GELU without SwiGLU: 'tanh' (GPT-2's 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))),
        Megatron-LM's --openai-gelu and its fused bias-GELU) or 'erf' (x Phi(x), torch's exact F.gelu, what
        Megatron-LM computes without either) (--gelu).
    qk_layernorm: a norm of `normalization`'s kind over each query and key head's kv_channels, after the
        projection and before rotary positions, one weight (kv_channels) per projection shared by every head
        (Megatron-LM's --qk-layernorm, Qwen3's q_norm / k_norm).
    qk_layernorm_full: instead, an RMSNorm over each token's whole query projection (heads x kv_channels, one
        weight element per channel) and one over its whole key projection (groups x kv_channels), at the same place
        (OLMo-2's q_norm / k_norm; --qk-layernorm-full).
    post_sublayer_norm: the layer's two norms on the attention and MLP outputs, before the residual add, instead
        of on their inputs (OLMo-2's reordered norm: x + drop(N(attn(x))); --post-sublayer-norm); the final norm
        stays.
    moe: the mixture of experts (`moe_config.MoEConfig`) in place of the MLP in the layers its pattern marks;
        None: every layer is dense. The experts are SwiGLU MLPs, so a MoE model has `swiglu` set.
    """
    max_position_embeddings: Optional[int] = None
    init_method_std: float = 0.02
    explicit_attention_mask: bool = False
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    rotary_percent: float = 1.0
    rope_scaling_factor: Optional[float] = None
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_positions: int = 8192
    normalization: str = "LayerNorm"
    swiglu: bool = False
    num_query_groups: Optional[int] = None
    add_bias_linear: bool = True
    add_qkv_bias: bool = False
    tie_word_embeddings: bool = True
    gelu: str = "tanh"
    qk_layernorm: bool = False
    qk_layernorm_full: bool = False
    post_sublayer_norm: bool = False
    moe: Optional[MoEConfig] = None

    def __post_init__(self):
        super().__post_init__()
        if isinstance(self.moe, dict):  # a record read back
            self.moe = MoEConfig(**self.moe)
        if self.moe is not None:
            if not self.swiglu:
                raise ValueError("the experts are SwiGLU MLPs: a MoE model needs swiglu")
            if self.moe.layer_pattern and len(self.moe.layer_pattern) != self.num_layers:
                raise ValueError(f"moe.layer_pattern lists {len(self.moe.layer_pattern)} layers, the model has "
                                 f"{self.num_layers}")
        if self.gelu not in GELUS:
            raise ValueError(f"gelu must be one of {GELUS}, got {self.gelu!r}")
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = swiglu_ffn_size(self.hidden_size) if self.swiglu else 4 * self.hidden_size
        if self.ffn_hidden_size < 1:
            raise ValueError(f"ffn_hidden_size must be >= 1, got {self.ffn_hidden_size} (hidden_size "
                             f"{self.hidden_size}); give it explicitly")
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.max_position_embeddings < self.seq_length:
            raise ValueError(f"max_position_embeddings ({self.max_position_embeddings}) < seq_length "
                             f"({self.seq_length})")
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        heads, groups = self.num_attention_heads, self.num_query_groups
        if groups < 1 or heads % groups:
            raise ValueError(f"num_query_groups ({groups}) must divide num_attention_heads ({heads})")
        if self.position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(f"position_embedding_type must be one of {POSITION_EMBEDDING_TYPES}, "
                             f"got {self.position_embedding_type!r}")
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        if self.position_embedding_type == "rope":
            self.rotary_dim()
        if self.qk_layernorm and self.qk_layernorm_full:
            raise ValueError("qk_layernorm (per head) and qk_layernorm_full (over the whole projection) exclude each "
                             "other")
        if self.qk_layernorm_full and self.normalization != "RMSNorm":
            raise ValueError(f"qk_layernorm_full is an RMSNorm; normalization is {self.normalization!r}")

    def rotary_dim(self) -> int:
        """The rotated width of each head: kv_channels x rotary_percent, an even number >= 2."""
        rot = self.kv_channels * self.rotary_percent
        if not 0.0 < self.rotary_percent <= 1.0 or rot != int(rot) or int(rot) % 2 or rot < 2:
            raise ValueError(f"rotary_percent {self.rotary_percent} of kv_channels {self.kv_channels} must be a "
                             f"positive even width (got {rot})")
        if self.rotary_base <= 0:
            raise ValueError(f"rotary_base must be > 0, got {self.rotary_base}")
        return int(rot)

    @property
    def moe_architecture(self) -> Optional[tuple]:
        """The experts' shape and function fields (`MoEConfig.architecture`), None for a dense model: what a checkpoint
        and a Hugging Face architecture must agree on."""
        return None if self.moe is None else self.moe.architecture()

    @property
    def qkv_bias(self) -> bool:
        return self.add_bias_linear or self.add_qkv_bias


@dataclass
class T5Config(TransformerConfig):
    """T5. `num_layers` is the encoder depth, `num_decoder_layers` the decoder's (default: the same);
    `seq_length` the encoder length, `decoder_seq_length` the decoder's (default: the same).

    feed_forward_proj: 'relu' (T5 v1.0) or 'gated-gelu' (v1.1: GELU-tanh(x W0) * (x W1)).
    tie_word_embeddings: True (v1.0): the LM head is the word table, output scaled by d^-0.5 first;
        False (v1.1): a separate vocab-parallel output weight and no scaling (HF T5's rule).
    relative_attention_num_buckets / relative_attention_max_distance: T5's position buckets (HF names).
    initializer_factor scales the HF T5 initialisation (q: (d*d_kv)^-0.5, k/v/wi/bias: d^-0.5,
    o: (heads*d_kv)^-0.5, wo: ff^-0.5, embedding and untied head: 1).
    """
    num_decoder_layers: Optional[int] = None
    decoder_seq_length: Optional[int] = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    feed_forward_proj: str = "relu"
    tie_word_embeddings: bool = True
    initializer_factor: float = 1.0
    layernorm_epsilon: float = 1e-6

    def __post_init__(self):
        super().__post_init__()
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.num_decoder_layers is None:
            self.num_decoder_layers = self.num_layers
        if self.decoder_seq_length is None:
            self.decoder_seq_length = self.seq_length
        if self.feed_forward_proj not in ("relu", "gated-gelu"):
            raise ValueError(f"T5Config.feed_forward_proj must be 'relu' or 'gated-gelu', "
                             f"got {self.feed_forward_proj!r}")
        if self.num_decoder_layers < 1:
            raise ValueError(f"T5Config.num_decoder_layers must be >= 1, got {self.num_decoder_layers}")
        buckets, distance = self.relative_attention_num_buckets, self.relative_attention_max_distance
        if buckets < 4 or distance <= buckets // 2:
            raise ValueError(f"T5Config needs relative_attention_num_buckets >= 4 and relative_attention_max_distance"
                             f" > num_buckets / 2, got {buckets} and {distance}")


GPT2Config = GPTConfig  # the earlier name, for code written against it
