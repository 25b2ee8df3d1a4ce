"""The planner's memory model on hand-computed small cases (the activation formulas against the tensors autograd
saves: test_activations.py)."""
from dataclasses import replace

import pytest

from megatron.model.config import GPTConfig, T5Config
from megatron.planning.activations import ActivationOptions, layer_bytes, recomputed_core_bytes
from megatron.planning.memory import Layout, predict_memory
from megatron.planning.model_shape import ModelShape, PipeLayer, layer_specs, partition
from megatron.planning.speed import Cluster, predict_step
from harness.dist import run_distributed

GPT = ModelShape.of(GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=64))
LAYER = PipeLayer("layer", 0, transformer=True)


def _with(shape: ModelShape, **fields) -> ModelShape:
    return ModelShape.of(replace(shape.config, **fields))


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
    default = predict_memory(GPT, Layout(dp=2, zero_stage=1))[0]  # DeepSpeed's 5e8, capped at the gradients
    assert default.buffers == 2 * 4 * default.params and default.peak < 1e7
    bf16 = predict_memory(GPT, Layout(dp=2, zero_stage=1, reduce_bucket=1000, precision="bf16"))[0]
    assert bf16.buffers == 2 * 2 * 1000 + 4 * bf16.params / 2  # + the fp32 gradient of this rank's partition


def test_in_flight_follows_the_schedule():
    one = predict_memory(GPT, Layout(pp=4, gas=8, zero_stage=0))
    assert [s.in_flight for s in one] == [4, 3, 2, 1]  # 1F1B: p - s
    inter = predict_memory(_with(GPT, num_layers=8),
                           Layout(pp=2, gas=4, schedule="interleaved", virtual_stages=2, zero_stage=0))
    assert inter[0].in_flight == 2 * (2 - 0 - 1) + (2 - 1) * 2 + 1  # Megatron's warm-up + 1 units


def test_gradients_the_first_backward_makes_are_not_at_its_peak():
    """fp32 and ZeRO-1 ranks start an iteration without gradients (the first backward makes param.grad): with as
    many micro-batches as stages, stage 0's peak is that backward, without them; with more, a later backward with
    as many in flight holds them. BF16_Optimizer's flat bf16 gradients exist before the first backward."""
    lay = Layout(pp=2, gas=2, micro_batch=4, zero_stage=0, attention="math")
    first = predict_memory(GPT, lay)[0]
    assert first.unmade_gradients == first.gradients > 0 and first.in_flight == 2
    assert first.peak == pytest.approx(first.static - first.gradients + first.activations + first.working)
    later = predict_memory(GPT, replace(lay, gas=4))[0]
    assert later.unmade_gradients == 0 and later.activations == first.activations
    assert later.peak - later.send_buffers - (first.peak - first.send_buffers) == pytest.approx(first.gradients)
    assert predict_memory(GPT, replace(lay, precision="bf16"))[0].unmade_gradients == 0


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
        assert layer_bytes(LAYER, GPT, slices) - layer_bytes(LAYER, GPT, gpu) \
            == 2 * b * s * h * (e - 1)
        assert spec_activation_bytes(PipeLayer("embed", 0), GPT, gpu) == 8 * b * s + 8 * s + b * s * h
        assert spec_activation_bytes(PipeLayer("embed", 0), GPT, ActivationOptions(b, 1, e)) \
            == 8 * b * s + 8 * s + b * s * h * e


def test_selective_recomputation_working_set_is_the_recomputed_core():
    """CPU's math path: in backward one layer's attention core is recomputed (what selective did not save, plus
    the whole (a, b, s, s) fp32 dropout mask drawn before a tp rank keeps its heads); GPUs' fused kernels: none."""
    b, s, a = 2, GPT.seq, GPT.config.num_attention_heads
    core = 3 * a * b * s * s * 4 / 2  # probabilities, mask, dropped probabilities; this rank's heads at tp = 2
    cpu = predict_memory(GPT, Layout(tp=2, micro_batch=b, recompute="selective", zero_stage=0, attention="math"))[0]
    assert recomputed_core_bytes(LAYER, GPT, ActivationOptions(b, 2, 4, recompute="selective")) \
        == core + a * b * s * s * 4
    assert cpu.working >= core + a * b * s * s * 4
    gpu = ActivationOptions(b, 2, 4, recompute="selective", attention="fused")
    assert recomputed_core_bytes(LAYER, GPT, gpu) == 0


T5 = ModelShape.of(T5Config(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=64,
                            decoder_seq_length=32, make_vocab_size_divisible_by=8))
T5G = _with(T5, tie_word_embeddings=False, feed_forward_proj="gated-gelu")
GPT8 = _with(GPT, make_vocab_size_divisible_by=8)
UNCHANGED_LAYOUTS = [
    Layout(micro_batch=2, gas=2, zero_stage=0, attention="math"),
    Layout(tp=2, micro_batch=2, gas=2, zero_stage=0, attention="math"),
    Layout(pp=2, micro_batch=2, gas=4, zero_stage=0, attention="math", schedule="zb-h1"),
    Layout(tp=2, pp=2, micro_batch=2, gas=4, sequence_parallel=True, recompute="selective", zero_stage=0,
           attention="math"),
    Layout(dp=2, micro_batch=2, gas=2, zero_stage=1, precision="bf16", attention="math", reduce_bucket=10 ** 6),
    Layout(pp=2, micro_batch=2, gas=4, recompute="full", zero_stage=0, attention="fused"),
    Layout(tp=2, micro_batch=2, gas=2, sequence_parallel=True, zero_stage=0, attention="fused", precision="bf16")]
UNCHANGED = [  # (shape, layout index, peak per stage, step seconds on the default Cluster) before the GPT layer options
    # (layout 4: its 1e6-element buckets capped at the rank's gradients since issue 33, 2 x 2 x (1e6 - Psi) less)
    (GPT8, 0, [9356928], 3.5858974870948854e-05),
    (GPT8, 1, [5181056], 2.029094687835193e-05),
    (GPT8, 2, [7156736, 7346304], 0.00011913849388797237),
    (GPT8, 3, [2971648, 2603904], 0.00010576119170430288),
    (GPT8, 4, [7772160], 3.7050797093171076e-05),
    (GPT8, 5, [3843072, 3848320], 0.00013679679652221218),
    (GPT8, 6, [3745152], 1.9125862433907486e-05),
    (T5, 0, [9653056], 2.8443113575647915e-05),
    (T5, 1, [5481280], 1.7732455398151595e-05),
    (T5, 2, [8051712, 6293312], 0.0001112502797069519),
    (T5, 3, [3544576, 2540096], 0.00010224032217409044),
    (T5, 4, [7876416], 2.975155802009236e-05),
    (T5, 5, [4151296, 3960576], 0.00012621237960583966),
    (T5, 6, [3942976], 1.598482873148493e-05),
    (T5G, 0, [12905280], 3.4450899941461335e-05),
    (T5G, 1, [7111488], 2.0736348581058305e-05),
    (T5G, 2, [10148864, 7210816], 0.00011775871493658311),
    (T5G, 3, [4593152, 2998848], 0.00010599518865272382),
    (T5G, 4, [10150208], 3.633505994146134e-05),
    (T5G, 5, [5068800, 4681472], 0.00013622535688219536),
    (T5G, 6, [5408320], 1.898872191439164e-05),
]


@pytest.mark.parametrize("shape,index,peaks,step", UNCHANGED)
def test_gpt2_and_t5_predictions_unchanged_by_the_gpt_layer_options(shape, index, peaks, step):
    lay = UNCHANGED_LAYOUTS[index]  # (gloo's send buffers, counted since, aside: test_gloo_send_buffers_...)
    assert [s.peak - s.send_buffers for s in predict_memory(shape, lay)] == pytest.approx(peaks, abs=1)
    assert predict_step(shape, lay, Cluster()).total == pytest.approx(step, rel=1e-12)


def test_gloo_send_buffers_live_through_the_iteration():
    """CPU (gloo, `attention="math"`): every activation message of the iteration, b s h e / t each, on every
    stage but the last (which sends from its chunks but the model's last one only); none on GPUs."""
    b, s, h = 2, GPT.seq, GPT.hidden
    cpu = Layout(tp=2, pp=2, micro_batch=b, gas=4, zero_stage=0, attention="math")
    assert [x.send_buffers for x in predict_memory(GPT, cpu)] == [4 * b * s * h * 4 / 2, 0]
    inter = replace(cpu, schedule="interleaved", virtual_stages=2)
    assert [x.send_buffers for x in predict_memory(GPT, inter)] == [8 * b * s * h * 4 / 2, 4 * b * s * h * 4 / 2]
    assert [x.send_buffers for x in predict_memory(GPT, replace(cpu, attention="fused"))] == [0, 0]


def test_an_embeddings_backward_makes_its_tables_gradient():
    """The first stage's last backward is its embedding's: it makes a dense gradient of the whole table before
    adding it to .grad. Where the table outweighs a layer's activations (a small model, a large vocabulary), that
    moment is the stage's peak: the working set is counted beside what the micro-batch no longer holds then (its
    layers' activations are freed), so the table shows in activations + working."""
    lay = Layout(pp=2, micro_batch=1, gas=4, zero_stage=0, attention="math")
    big_vocab = _with(GPT, vocab_size=64000)
    table = layer_specs(big_vocab, 1)[0].params * 4
    first, small = predict_memory(big_vocab, lay)[0], predict_memory(GPT, lay)[0]
    assert first.activations + first.working > table > small.activations + small.working
    assert first.working > 10 * small.working


LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=16,
             position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
             add_bias_linear=False, tie_word_embeddings=False)
GPT_LAYERS = {  # GPT2Config options: the Llama family's layer, Qwen2's (a qkv bias), Qwen3's (query / key norms, head
    # width 24 instead of h / a), OLMo-2's (query / key norms over all heads, split over tp), and mixtures with GPT-2's
    "llama": LLAMA,
    "qwen2": {**LLAMA, "add_qkv_bias": True, "tie_word_embeddings": True},
    "qwen3": {**LLAMA, "qk_layernorm": True, "kv_channels": 24},
    "olmo2": {**LLAMA, "qk_layernorm_full": True, "post_sublayer_norm": True},
    "gpt2-qk-layernorm": dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=16,
                              qk_layernorm=True),
    "gqa-layernorm-bias-none": dict(LLAMA, position_embedding_type="none", normalization="LayerNorm",
                                    add_bias_linear=True, swiglu=False),
    "gpt2": dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=16),
}


def _built_parameters(options: dict, tp: int) -> list:
    """Parameters on this rank of each module the GPT Pipe model's specs build: embedding, layers, final norm, head."""
    from megatron import mpu
    from megatron.model.config import GPT2Config
    from megatron.model.gpt2_model import GPT2Embedding, GPT2LMHead, final_layernorm
    from megatron.model.transformer import TransformerLayer
    group = mpu.initialize_model_parallel(tp, 1).tp_group if tp > 1 else None
    cfg = GPT2Config(**options)
    count = lambda module: sum(p.numel() for p in module.parameters())  # noqa: E731
    embed = count(GPT2Embedding(cfg, group))
    head = embed if cfg.tie_word_embeddings else count(GPT2LMHead(cfg, group))
    built = [embed, *[count(TransformerLayer(cfg, i + 1, group)) for i in range(cfg.num_layers)],
             count(final_layernorm(cfg, group)), head]
    if tp > 1:
        mpu.destroy_model_parallel()
    return built


@pytest.mark.parametrize("name", GPT_LAYERS)
def test_gpt_layer_options_parameters_equal_the_built_modules(name):
    from megatron.model.config import GPT2Config
    from megatron.model.gpt2_model import GPT2Model
    cfg = GPT2Config(**GPT_LAYERS[name])
    shape = ModelShape.of(cfg)
    specs = [s.params for s in layer_specs(shape, 1)]
    assert specs == _built_parameters(GPT_LAYERS[name], 1)
    whole = sum(p.numel() for p in GPT2Model(cfg).parameters())
    assert predict_memory(shape, Layout(zero_stage=0))[0].params == whole  # a tied head is the embedding


def test_gpt_layer_options_parameters_equal_the_built_modules_at_tp2():
    for name, options in GPT_LAYERS.items():
        from megatron.model.config import GPT2Config
        shape = ModelShape.of(GPT2Config(**options))
        expected = [s.params for s in layer_specs(shape, 2)]
        for built in run_distributed(_built_parameters, 2, options, 2, timeout=300):
            assert built == expected, name


def test_llama_parameters_by_hand():
    # h = 64, a = 4, G = 2, d = 16, f = 128 (SwiGLU's default), V_p = 1024, tp = 2
    shape = ModelShape.of(GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=1000, seq_length=16,
                                    ffn_hidden_size=128, swiglu=True, num_query_groups=2, add_bias_linear=False,
                                    normalization="RMSNorm", position_embedding_type="rope", tie_word_embeddings=False))
    qkv, dense, mlp = 64 * (4 + 2 * 2) * 16, 64 * 64, 64 * 2 * 128 + 128 * 64
    assert [s.params for s in layer_specs(shape, 2)] == [1024 * 64 // 2, *[(qkv + dense + mlp) // 2 + 2 * 64] * 2,
                                                        64, 1024 * 64 // 2]
