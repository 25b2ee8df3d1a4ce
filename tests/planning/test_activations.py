"""The planner's activation formulas (megatron.planning.activations) against the tensors autograd really saves in
megatron.model's layers (saved_tensors_hooks): GPT-2's and T5's layers, and the Llama family's GPT layer (rotary
positions, RMSNorm, SwiGLU, grouped-query attention, no biases) at tp 1 and 2, with and without sequence
parallelism, dropout and selective recomputation, in fp32 and bf16; with the query / key norms (--qk-layernorm
as Qwen3's RMSNorm, and as LayerNorm on multi-head attention) and OLMo-2's layer (--qk-layernorm-full,
--post-sublayer-norm)."""
import pytest
import torch

from megatron.planning.activations import ActivationOptions, layer_bytes
from harness.dist import run_distributed
from megatron.planning.model_shape import ModelShape, PipeLayer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAYER = PipeLayer("layer", 0, transformer=True)


def _saved_bytes(layer, *inputs):
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    flat = [t for x in inputs for t in (x if isinstance(x, tuple) else (x,))]
    ins = {t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor)}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = (st.nbytes(), st.data_ptr() in ins)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(*inputs)
    return seen


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("b,s,h,a", [(2, 16, 32, 4), (3, 24, 48, 6)])
def test_gpt_layer_formula_matches_saved_tensors(dtype, b, s, h, a):
    from megatron.model.config import GPT2Config
    from megatron.model.transformer import TransformerLayer
    cfg = GPT2Config(num_layers=2, hidden_size=h, num_attention_heads=a, vocab_size=64, seq_length=s,
                     params_dtype=dtype)
    layer = TransformerLayer(cfg, 1)
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    seen = _saved_bytes(layer, x, torch.ones(s, s, dtype=torch.bool).triu(1)[None, None])
    e = torch.tensor([], dtype=dtype).element_size()
    assert sum(n for n, _ in seen.values()) == layer_bytes(LAYER, ModelShape.of(cfg), ActivationOptions(b, 1, e))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_t5_layer_formulas_match_saved_tensors(dtype):
    from megatron.model.config import T5Config
    from megatron.model.t5_pipe import T5DecoderTransformerLayerPipe, T5EncoderTransformerLayerPipe
    b, se, sd, h, a = 2, 16, 8, 32, 4
    cfg = T5Config(num_layers=2, hidden_size=h, num_attention_heads=a, vocab_size=64, seq_length=se,
                   decoder_seq_length=sd, params_dtype=dtype)
    shape = ModelShape.of(cfg)
    e = torch.tensor([], dtype=dtype).element_size()
    enc = torch.randn(b, se, h, dtype=dtype, requires_grad=True)
    dec = torch.randn(b, sd, h, dtype=dtype, requires_grad=True)
    masks = (torch.zeros(b, 1, se, se, dtype=torch.bool), torch.ones(sd, sd, dtype=torch.bool).triu(1)
             .expand(b, 1, sd, sd).contiguous(), torch.zeros(b, 1, sd, se, dtype=torch.bool))
    ep = torch.randn(a, 2 * se - 1, dtype=dtype, requires_grad=True)
    dp_ = torch.randn(a, 2 * sd - 1, dtype=dtype, requires_grad=True)
    o = ActivationOptions(b, 1, e)
    saved = _saved_bytes(T5EncoderTransformerLayerPipe(cfg, 2, False), (enc, masks[0], dec, *masks[1:], ep, dp_))
    assert sum(n for n, _ in saved.values()) == layer_bytes(PipeLayer("enc", 0, transformer=True), shape, o)
    saved = _saved_bytes(T5DecoderTransformerLayerPipe(cfg, 4, False), (enc, masks[0], dec, *masks[1:], ep, dp_))
    # the encoder output it attends to is held once per stage, not per layer; in fp32 RMSNorm keeps the
    # layer's input itself (in bf16 an fp32 copy, already among the non-inputs)
    own = sum(n for n, is_input in saved.values() if not is_input) + (b * sd * h * 4 if e == 4 else 0)
    assert own == layer_bytes(PipeLayer("dec", 0, transformer=True), shape, o)


# the Llama family's layer: rope, RMSNorm, SwiGLU (f = 128 for h = 64), G = 2 groups of 2 heads, no biases
LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=64, seq_length=16,
             position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
             add_bias_linear=False, tie_word_embeddings=False)
B = 2


def _llama_config(dtype: str, dropout: float, recompute: str, **extra):
    from megatron.model.config import GPT2Config
    return GPT2Config(**{**LLAMA, **extra}, params_dtype=DTYPES[dtype], hidden_dropout=dropout,
                      attention_dropout=dropout, recompute_granularity=None if recompute == "none" else recompute)


def _llama_layer_saved(cases: list, tp: int) -> list:
    """Per case (dtype, dropout, sequence parallel, recompute[, layer options]): the bytes one GPT layer saves on
    this rank, its rotary cos / sin tables left out (held by the layer from its first forward on, not per
    micro-batch)."""
    from megatron import mpu
    from megatron.model.transformer import TransformerLayer
    state = mpu.initialize_model_parallel(tp, 1) if tp > 1 else None
    out = []
    for dtype, dropout, sp, recompute, *options in cases:
        cfg = _llama_config(dtype, dropout, recompute, **(options[0] if options else {}))
        layer = TransformerLayer(cfg, 1, state.tp_group if state else None, sequence_parallel=sp)
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(B, cfg.seq_length // tp if sp else cfg.seq_length, cfg.hidden_size, generator=gen)
        seen = _saved_bytes(layer, x.to(DTYPES[dtype]).requires_grad_())
        tables = {t.untyped_storage().data_ptr() for pair in layer.self_attention.rotary._tables.values()
                  for t in pair}
        out.append(sum(n for ptr, (n, _) in seen.items() if ptr not in tables))
    if state:
        mpu.destroy_model_parallel()
    return out


def _llama_predicted(case, tp: int) -> float:
    dtype, dropout, sp, recompute, *options = case
    shape = ModelShape.of(_llama_config(dtype, dropout, recompute, **(options[0] if options else {})))
    e = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    o = ActivationOptions(B, tp, e, sequence_parallel=sp, recompute=recompute, attention="math")
    return layer_bytes(LAYER, shape, o)


TP1 = [(dtype, dropout, False, recompute) for dtype in DTYPES for dropout in (0.0, 0.1)
       for recompute in ("none", "selective")]


@pytest.mark.parametrize("case", TP1, ids=lambda c: f"{c[0]}-dropout{c[1]}-{c[3]}")
def test_llama_layer_formula_matches_saved_tensors(case):
    """CPU: with attention dropout, attention_core's explicit form (k, v repeated to every head, fp32); without,
    SDPA's flash kernel (k, v with G heads, the rotated q, k and the fused QKV output they are cut from)."""
    assert _llama_layer_saved([case], 1) == [_llama_predicted(case, 1)]


# Qwen3's query / key norms on the Llama layer (kv_channels 24: not h / a), as LayerNorm on multi-head attention,
# and OLMo-2's layer (an RMSNorm over all heads, the norms on the sublayers' outputs), also with LayerNorm there
QK_NORMS = {"qwen3": dict(qk_layernorm=True, kv_channels=24),
            "layernorm-mha": dict(qk_layernorm=True, normalization="LayerNorm", num_query_groups=None),
            "olmo2": dict(qk_layernorm_full=True, post_sublayer_norm=True),
            "post-layernorm": dict(post_sublayer_norm=True, normalization="LayerNorm")}


@pytest.mark.parametrize("options", QK_NORMS)
@pytest.mark.parametrize("case", TP1, ids=lambda c: f"{c[0]}-dropout{c[1]}-{c[3]}")
def test_query_key_norm_formulas_match_saved_tensors(case, options):
    """A query / key norm keeps its input (the fused QKV output; RMSNorm in bf16 an fp32 copy), its normalised
    input and statistics; the normalised q and k enter the core as the rotated ones do. Norms on the sublayers'
    outputs keep what pre-norms keep."""
    case = (*case, QK_NORMS[options])
    assert _llama_layer_saved([case], 1) == [_llama_predicted(case, 1)]


def test_llama_layer_formula_matches_saved_tensors_at_tp2():
    """Each rank holds G / t groups and a / t heads; with sequence parallelism the norms, masks and the GEMMs'
    stored inputs hold s / t positions (the query / key norms see the whole sequence of this rank's heads)."""
    qwen3 = QK_NORMS["qwen3"]
    cases = [("fp32", 0.1, False, "none"), ("fp32", 0.0, False, "none"), ("fp32", 0.1, True, "none"),
             ("bf16", 0.0, True, "none"), ("fp32", 0.1, True, "selective"), ("bf16", 0.1, False, "selective"),
             ("fp32", 0.0, True, "selective"), ("fp32", 0.1, True, "none", qwen3), ("bf16", 0.0, False, "none", qwen3),
             ("bf16", 0.1, False, "selective", QK_NORMS["layernorm-mha"]),
             ("fp32", 0.1, True, "none", QK_NORMS["olmo2"]), ("bf16", 0.0, True, "selective", QK_NORMS["olmo2"])]
    per_rank = run_distributed(_llama_layer_saved, 2, cases, 2, timeout=300)
    predicted = [_llama_predicted(c, 2) for c in cases]
    for measured in per_rank:
        assert measured == predicted, list(zip(cases, measured, predicted))


def test_gpt2_layer_formula_matches_saved_tensors_without_dropout():
    """GPT-2's layer without dropout on CPU runs SDPA's flash kernel: the fused-attention terms (no s^2 tensors)."""
    from megatron.model.config import GPT2Config
    from megatron.model.transformer import TransformerLayer
    cfg = GPT2Config(num_layers=2, hidden_size=48, num_attention_heads=6, vocab_size=64, seq_length=24,
                     hidden_dropout=0.0, attention_dropout=0.0)
    x = torch.randn(3, 24, 48, requires_grad=True)
    seen = _saved_bytes(TransformerLayer(cfg, 1), x)
    o = ActivationOptions(3, 1, 4, attention="math")
    assert sum(n for n, _ in seen.values()) == layer_bytes(LAYER, ModelShape.of(cfg), o)


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_formula_matches_saved_tensors(dtype, fused):
    """The head spec's loss part: the eager cross entropy saves an fp32 softmax (4 bytes per logit), the fused one
    (--cross-entropy-loss-fusion) the logits themselves (e) and 8 bytes per token; labels and mask 13 per token.
    The head's GEMM keeps only its input (the final norm's output, counted there) and its weight."""
    from megatron.model.language_model import masked_lm_loss
    from megatron.planning.activations import spec_activation_bytes
    b, s, v = 2, 8, 64
    logits = torch.randn(b, s, v, dtype=dtype, requires_grad=True)
    labels, mask = torch.randint(0, v, (b, s)), torch.ones(b, s)

    class Loss(torch.nn.Module):
        def forward(self, x):
            return masked_lm_loss(x, labels, mask, fused=fused)
    seen = _saved_bytes(Loss(), logits)
    counted = sum(n for n, _ in seen.values() if n > 4)  # not the loss's scalar denominator
    from megatron.model.config import GPTConfig
    shape = ModelShape.of(GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=v, seq_length=s,
                                    make_vocab_size_divisible_by=8))
    e = torch.tensor([], dtype=dtype).element_size()
    assert counted == spec_activation_bytes(PipeLayer("head", 0), shape, ActivationOptions(b, 1, e, loss_fusion=fused))
