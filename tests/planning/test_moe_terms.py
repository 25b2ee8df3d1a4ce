"""The planner's mixture-of-experts terms (megatron/planning/moe.py) against the built layers: a MoE layer's
parameters, the tensors autograd keeps after its forward (`saved_tensors_hooks`, those still alive), the experts'
parameters per rank at expert-parallel sizes 1 and 2, and the ranking's MoE rules. Measured peaks:
test_measured.py."""
import gc
import weakref

import pytest
import torch

from megatron.errors import UserError
from megatron.model.moe_config import MoEConfig
from megatron.planning.activations import ActivationOptions, layer_bytes
from megatron.planning.memory import Layout, predict_memory
from megatron.planning.model_shape import ModelShape, layer_specs
from megatron.planning.moe import MoEPipeLayer, moe_flops_delta, routed_expert_params
from megatron.planning.search import enumerate_layouts
from megatron.planning.speed import Cluster

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# the Llama family's layer (h 64, f 128, G 2, no biases) with the golden MoE model's experts (8 of width 24, top-2,
# a shared expert of 32, tests/training/golden_cases.py) in its second layer
LLAMA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=64, seq_length=32,
             position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
             add_bias_linear=False, tie_word_embeddings=False, hidden_dropout=0.0, attention_dropout=0.0)
GOLDEN = dict(num_experts=8, ffn_hidden_size=24, topk=2, shared_ffn_hidden_size=32, aux_loss_coeff=0.01,
              z_loss_coeff=0.001, router_dtype="fp64", layer_pattern=(0, 1))
ROUTINGS = {
    "golden": GOLDEN,
    "plain": dict(num_experts=8, ffn_hidden_size=24, topk=2),
    "capacity": dict(num_experts=8, ffn_hidden_size=24, topk=2, capacity_factor=0.5),
    "gate-sigmoid": dict(num_experts=4, ffn_hidden_size=16, topk=3, score_function="sigmoid",
                         shared_ffn_hidden_size=16, shared_gate=True, aux_loss_coeff=0.01),
    "pre-softmax": dict(num_experts=8, ffn_hidden_size=24, topk=2, pre_softmax=True, z_loss_coeff=0.001),
}
B = 2


def _config(routing: str, dtype: str = "fp32", **extra):
    """The layer's configuration; with num_layers 4 the golden pattern repeats (0, 1, 0, 1)."""
    from megatron.model.config import GPT2Config
    moe = ROUTINGS[routing]
    if "layer_pattern" in moe:
        moe = {**moe, "layer_pattern": (0, 1) * (extra.get("num_layers", 2) // 2)}
    return GPT2Config(**{**LLAMA, **extra}, params_dtype=DTYPES[dtype], moe=MoEConfig(**moe))


def _kept_bytes(layer, x) -> int:
    """Bytes of the tensors autograd saved in `layer(x)` and still holds after it (a tensor saved by a graph that
    the output does not reach, such as the capacity's top-k over the experts, dies with it); the parameters and
    the rotary tables (held from the first forward on) left out, the layer's input counted (its first norm keeps
    it, as tests/planning/test_activations.py counts it)."""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(weakref.ref(t)) or t, lambda t: t):
        out = layer(x)
    gc.collect()
    held = {t.untyped_storage().data_ptr() for t in layer.parameters()}
    held |= {t.untyped_storage().data_ptr() for pair in layer.self_attention.rotary._tables.values() for t in pair}
    alive = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
             for t in (w() for w in saved) if t is not None}
    del out
    return sum(n for ptr, n in alive.items() if ptr not in held)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing", ROUTINGS)
def test_moe_layer_formula_matches_saved_tensors(routing, dtype):
    from megatron.model.transformer import TransformerLayer
    cfg = _config(routing, dtype)
    torch.manual_seed(0)
    layer = TransformerLayer(cfg, 2)
    x = torch.randn(B, cfg.seq_length, cfg.hidden_size).to(DTYPES[dtype]).requires_grad_()
    spec = layer_specs(ModelShape.of(cfg), 1)[2]
    assert isinstance(spec, MoEPipeLayer)
    e = torch.tensor([], dtype=DTYPES[dtype]).element_size()
    assert _kept_bytes(layer, x) == layer_bytes(spec, ModelShape.of(cfg), ActivationOptions(B, 1, e))


@pytest.mark.parametrize("routing,extra", [("golden", {}), ("gate-sigmoid", {"add_bias_linear": True}),
                                           ("plain", {"add_bias_linear": True, "swiglu": True})])
def test_moe_layer_parameters_equal_the_built_layer(routing, extra):
    from megatron.model.transformer import TransformerLayer
    cfg = _config(routing, **extra)
    specs = layer_specs(ModelShape.of(cfg), 1)
    for number in (1, 2):
        built = sum(p.numel() for p in TransformerLayer(cfg, number).parameters())
        assert specs[number].params == built
        assert isinstance(specs[number], MoEPipeLayer) == cfg.moe.is_moe_layer(number)


def test_expert_parameters_per_rank_halve_from_ep1_to_ep2():
    """Each rank of an expert-parallel group of 2 holds half of each MoE layer's routed experts: their weight,
    gradient and Adam bytes per rank halve, the rest of the layer (router, shared expert, attention) stays."""
    m = ModelShape.of(_config("golden", num_layers=4, seq_length=64))
    layers = {ep: [s for s in layer_specs(m, 1, ep) if isinstance(s, MoEPipeLayer)] for ep in (1, 2)}
    assert [s.experts for s in layers[2]] == [s.experts // 2 for s in layers[1]] and layers[1][0].experts > 0
    assert routed_expert_params(m.config, 1) == 3 * 64 * 24 * 8
    one, two = (predict_memory(m, Layout(dp=2, gas=2, zero_stage=0, ep=ep))[0] for ep in (1, 2))
    halved = sum(s.experts for s in layers[1]) // 2  # the experts' parameters one rank no longer holds
    assert one.params - two.params == halved
    for part, per_param in (("weights", 4), ("gradients", 4), ("optimizer", 8)):
        assert getattr(one, part) - getattr(two, part) == per_param * halved
    assert one.activations == two.activations  # dropless and balanced: each rank's experts receive T k rows


def test_capacity_bounds_the_rows_and_dropless_counts_every_copy():
    o = ActivationOptions(B, 1, 4)
    dropless, capacity = (layer_bytes(layer_specs(ModelShape.of(_config(r)), 1)[2], ModelShape.of(_config(r)), o)
                          for r in ("plain", "capacity"))
    T, k, E, h, f = B * 32, 2, 8, 64, 24
    rows = E * -(-T * k // E // 2)  # every expert at its capacity ceil(T k / E x 0.5)
    assert dropless - capacity == (T * k - rows) * ((h + 4 * f) * 4 + 2 * h * 4 + 4 + 16)


def test_ranking_keeps_what_the_code_runs_for_experts():
    """tp > 1 only with sequence parallelism; ep given: it divides tp x dp, and at ep 2 only fp32 ZeRO 0 runs."""
    m = ModelShape.of(_config("golden", num_layers=4, seq_length=64))
    c = Cluster(gpus_per_node=4)
    layouts = enumerate_layouts(m, c, 8, "fp32", ep=2)
    assert layouts and all(lay.zero_stage == 0 and (lay.tp * lay.dp) % 2 == 0 and lay.ep == 2 for lay in layouts)
    assert all(lay.sequence_parallel for lay in enumerate_layouts(m, c, 8, "bf16") if lay.tp > 1)
    with pytest.raises(UserError, match="--expert-model-parallel-size 2 runs in fp32 only for now"):
        enumerate_layouts(m, c, 8, "bf16", ep=2)
    tokens, h = 8 * 64, 64  # 2 MoE layers: router 2 T h E, top-2 of 24 and the shared 32 against the dense 128
    assert moe_flops_delta(m.config, 8, False) == 3 * 2 * tokens * h * (2 * 8 + 6 * (2 * 24 + 32) - 6 * 128)
    with pytest.raises(UserError, match="--num-experts 8 is not divisible by --expert-model-parallel-size 3"):
        layer_specs(m, 1, 3)
