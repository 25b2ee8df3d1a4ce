"""The planner's memory model on hand-computed small cases, and its activation formulas against the tensors
autograd really saves in megatron.model's layers (saved_tensors_hooks)."""
import pytest
import torch

from megatron.planning.activations import ActivationOptions, layer_bytes, recomputed_core_bytes
from megatron.planning.memory import Layout, predict_memory
from megatron.planning.model_shape import ModelShape, Spec, layer_specs, partition

GPT = ModelShape("gpt", num_layers=4, hidden=64, heads=4, kv_channels=16, ffn=256, vocab=1000, seq=64,
                 max_positions=64)


def test_gpt_parameters_by_hand():
    # h = 64: a layer is 12 h^2 + 13 h = 49984; embedding 1024 x 64 (padded from 1000) + 64 x 64 positions
    specs = layer_specs(GPT, tp=1)
    assert [s.params for s in specs] == [69632, 49984, 49984, 49984, 49984, 128, 69632]
    one_stage = predict_memory(GPT, Layout(zero_stage=0))[0]
    assert one_stage.params == 69632 + 4 * 49984 + 128  # tied head and embedding: one module on one stage
    tp2 = layer_specs(GPT, tp=2)
    assert tp2[1].params == (12 * 64 * 64 + 3 * 64 + 256) // 2 + 6 * 64  # matrices, qkv and fc1 biases split


def test_tied_embedding_on_first_and_last_stage():
    stages = predict_memory(GPT, Layout(pp=2, gas=4, zero_stage=0))
    assert partition(layer_specs(GPT, 1), 2) == [0, 3, 7]
    assert stages[0].params == 69632 + 2 * 49984
    assert stages[1].params == 2 * 49984 + 128 + 69632  # the last stage holds its own copy of the table


@pytest.mark.parametrize("precision,zero,dp,expect", [
    ("fp32", 0, 1, (4, 4, 8)),            # torch AdamW: weights, grads, two moments
    ("fp32", 1, 2, (4, 4, 12 / 2)),       # ZeRO-1: fp32 partition + moments over dp
    ("bf16", 1, 4, (2, 2, 12 / 4)),       # bf16 gradients (the partition's fp32 gradient is a reduce buffer)
    ("bf16", 0, 1, (2, 2, 14)),           # BF16_Optimizer: bf16 gradients until folded into its accumulators
])
def test_state_bytes_per_parameter(precision, zero, dp, expect):
    s = predict_memory(GPT, Layout(dp=dp, zero_stage=zero, precision=precision))[0]
    assert (s.weights / s.params, s.gradients / s.params, s.optimizer / s.params) == pytest.approx(expect)


def test_zero1_reduce_buckets_counted():
    s = predict_memory(GPT, Layout(dp=2, zero_stage=1, reduce_bucket=1000))[0]
    assert s.buffers == 2 * 4 * 1000
    assert predict_memory(GPT, Layout(dp=2, zero_stage=1))[0].peak > 4e9  # DeepSpeed's default 5e8 elements
    bf16 = predict_memory(GPT, Layout(dp=2, zero_stage=1, reduce_bucket=1000, precision="bf16"))[0]
    assert bf16.buffers == 2 * 2 * 1000 + 4 * bf16.params / 2  # + the fp32 gradient of this rank's partition


def test_in_flight_follows_the_schedule():
    one = predict_memory(GPT, Layout(pp=4, gas=8, zero_stage=0))
    assert [s.in_flight for s in one] == [4, 3, 2, 1]  # 1F1B: p - s
    inter = predict_memory(ModelShape(**{**GPT.__dict__, "num_layers": 8}),
                           Layout(pp=2, gas=4, schedule="interleaved", virtual_stages=2, zero_stage=0))
    assert inter[0].in_flight == 2 * (2 - 0 - 1) + (2 - 1) * 2 + 1  # Megatron's warm-up + 1 units


def test_recompute_and_sequence_parallel_reduce_activations():
    for attention in ("math", "fused"):
        base = predict_memory(GPT, Layout(tp=2, zero_stage=0, attention=attention))[0]
        sp = predict_memory(GPT, Layout(tp=2, sequence_parallel=True, zero_stage=0, attention=attention))[0]
        sel = predict_memory(GPT, Layout(tp=2, recompute="selective", zero_stage=0, attention=attention))[0]
        full = predict_memory(GPT, Layout(tp=2, recompute="full", zero_stage=0, attention=attention))[0]
        assert full.activations < base.activations and sp.activations < base.activations
        if attention == "math":
            assert full.activations < sel.activations < base.activations
        else:  # fused kernels keep no s^2 tensors: selective leaves the core alone (megatron.model.attention.core)
            assert sel.activations == base.activations and sel.peak == base.peak


def test_gpu_hidden_dropout_masks_counted_as_bool_outside_sequence_parallel():
    """CUDA's dropout keeps a bool mask; CPU's, and SeededDropout's sequence-parallel slices on either, keep the
    activations' dtype: on a GPU a layer's two hidden masks and GPT's embedding mask cost b s h bytes each."""
    from megatron.planning.activations import spec_activation_bytes
    b, s, h = 2, GPT.seq, GPT.hidden
    for e in (4, 2):
        gpu = ActivationOptions(b, 1, e, attention="fused")
        slices = ActivationOptions(b, 1, e, sequence_parallel=True, attention="fused")  # at t = 1: masks only
        assert layer_bytes(Spec("layer", 0), GPT, slices) - layer_bytes(Spec("layer", 0), GPT, gpu) \
            == 2 * b * s * h * (e - 1)
        assert spec_activation_bytes(Spec("embed", 0), GPT, gpu) == 8 * b * s + 8 * s + b * s * h
        assert spec_activation_bytes(Spec("embed", 0), GPT, ActivationOptions(b, 1, e)) \
            == 8 * b * s + 8 * s + b * s * h * e


def test_selective_recomputation_working_set_is_the_recomputed_core():
    """CPU's math path: in backward one layer's attention core is recomputed (what selective did not save, plus
    the whole (a, b, s, s) fp32 dropout mask drawn before a tp rank keeps its heads); GPUs' fused kernels: none."""
    b, s, a = 2, GPT.seq, GPT.heads
    core = 3 * a * b * s * s * 4 / 2  # probabilities, mask, dropped probabilities; this rank's heads at tp = 2
    cpu = predict_memory(GPT, Layout(tp=2, micro_batch=b, recompute="selective", zero_stage=0, attention="math"))[0]
    assert recomputed_core_bytes(Spec("layer", 0), GPT, ActivationOptions(b, 2, 4, recompute="selective")) \
        == core + a * b * s * s * 4
    assert cpu.working >= core + a * b * s * s * 4
    gpu = ActivationOptions(b, 2, 4, recompute="selective", attention="fused")
    assert recomputed_core_bytes(Spec("layer", 0), GPT, gpu) == 0


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
    layer = TransformerLayer(GPT2Config(num_layers=2, hidden_size=h, num_attention_heads=a, vocab_size=64,
                                        seq_length=s, params_dtype=dtype), 1)
    x = torch.randn(b, s, h, dtype=dtype, requires_grad=True)
    seen = _saved_bytes(layer, x, torch.ones(s, s, dtype=torch.bool).triu(1)[None, None])
    shape = ModelShape("gpt", 2, h, a, h // a, 4 * h, 64, s, max_positions=s)
    e = torch.tensor([], dtype=dtype).element_size()
    assert sum(n for n, _ in seen.values()) == layer_bytes(Spec("layer", 0), shape, ActivationOptions(b, 1, e))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_t5_layer_formulas_match_saved_tensors(dtype):
    from megatron.model.config import T5Config
    from megatron.model.t5_pipe import T5DecoderTransformerLayerPipe, T5EncoderTransformerLayerPipe
    b, se, sd, h, a = 2, 16, 8, 32, 4
    cfg = T5Config(num_layers=2, hidden_size=h, num_attention_heads=a, vocab_size=64, seq_length=se,
                   decoder_seq_length=sd, params_dtype=dtype)
    shape = ModelShape("t5", 2, h, a, h // a, 4 * h, 64, se, decoder_layers=2, decoder_seq=sd)
    e = torch.tensor([], dtype=dtype).element_size()
    enc = torch.randn(b, se, h, dtype=dtype, requires_grad=True)
    dec = torch.randn(b, sd, h, dtype=dtype, requires_grad=True)
    masks = (torch.zeros(b, 1, se, se, dtype=torch.bool), torch.ones(sd, sd, dtype=torch.bool).triu(1)
             .expand(b, 1, sd, sd).contiguous(), torch.zeros(b, 1, sd, se, dtype=torch.bool))
    ep = torch.randn(a, 2 * se - 1, dtype=dtype, requires_grad=True)
    dp_ = torch.randn(a, 2 * sd - 1, dtype=dtype, requires_grad=True)
    o = ActivationOptions(b, 1, e)
    saved = _saved_bytes(T5EncoderTransformerLayerPipe(cfg, 2, False), (enc, masks[0], dec, *masks[1:], ep, dp_))
    assert sum(n for n, _ in saved.values()) == layer_bytes(Spec("enc", 0), shape, o)
    saved = _saved_bytes(T5DecoderTransformerLayerPipe(cfg, 4, False), (enc, masks[0], dec, *masks[1:], ep, dp_))
    # the encoder output it attends to is held once per stage, not per layer; in fp32 RMSNorm keeps the
    # layer's input itself (in bf16 an fp32 copy, already among the non-inputs)
    own = sum(n for n, is_input in saved.values() if not is_input) + (b * sd * h * 4 if e == 4 else 0)
    assert own == layer_bytes(Spec("dec", 0), shape, o)
