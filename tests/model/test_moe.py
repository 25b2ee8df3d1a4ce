"""megatron/model/moe.py, one rank's mixture-of-experts layer, against transformers' own MoE blocks and Megatron's
definitions:

- Mixtral (softmax after top-k: the renormalized top-k), Qwen2-MoE (pre-softmax, not renormalized; a shared expert
  behind a sigmoid gate) and OLMoE (pre-softmax) built by transformers with random weights: the same output and the
  same gradients of the input, the router and the experts (fp32, relative error under 1e-5);
- the load-balancing loss is Megatron's: coeff at uniform routing, and transformers' `load_balancing_loss_func` of
  the same logits divided by top-k;
- capacity: no expert keeps more than ceil(T k / E c) tokens, under either drop policy ("position" keeps the earliest
  tokens), and a capacity that drops nothing gives the dropless bits;
- sigmoid routing with an expert bias: the bias picks the experts, the unbiased scores weigh them;
- an expert that gets no token leaves its weights without gradient, and the rest trains;
- each bad setting is one line naming the flag and the value.
"""
from __future__ import annotations

import math

import pytest
import torch

from megatron.model.moe import MoEConfig, MoELayer, aux_loss, capacity, drop_over_capacity, route, tokens_per_expert

H, F_EXPERT, E, K = 16, 24, 8, 2


def _hf_block(family: str):
    import transformers
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.olmoe.modeling_olmoe import OlmoeSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    torch.manual_seed(0)
    if family == "mixtral":
        cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=F_EXPERT, num_local_experts=E,
                                         num_experts_per_tok=K)
        block = MixtralSparseMoeBlock(cfg)
    elif family == "qwen2_moe":
        cfg = transformers.Qwen2MoeConfig(hidden_size=H, moe_intermediate_size=F_EXPERT, num_experts=E,
                                          num_experts_per_tok=K, shared_expert_intermediate_size=32,
                                          norm_topk_prob=False)
        block = Qwen2MoeSparseMoeBlock(cfg)
    else:
        cfg = transformers.OlmoeConfig(hidden_size=H, intermediate_size=F_EXPERT, num_experts=E,
                                       num_experts_per_tok=K, norm_topk_prob=False)
        block = OlmoeSparseMoeBlock(cfg)
    for p in block.parameters():
        torch.nn.init.normal_(p, 0.0, 0.3)
    return block


def _ours(family: str, block) -> MoELayer:
    shared = family == "qwen2_moe"
    cfg = MoEConfig(num_experts=E, ffn_hidden_size=F_EXPERT, topk=K, pre_softmax=family != "mixtral",
                    shared_ffn_hidden_size=32 if shared else None, shared_gate=shared)
    layer = MoELayer(cfg, H)
    with torch.no_grad():
        layer.router.weight.copy_(block.gate.weight)
        layer.experts.linear_fc1.copy_(block.experts.gate_up_proj)  # (E, 2f, h), gate rows first
        layer.experts.linear_fc2.copy_(block.experts.down_proj)  # (E, h, f)
        if shared:
            mlp = block.shared_expert
            layer.shared_expert.linear_fc1.copy_(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
            layer.shared_expert.linear_fc2.copy_(mlp.down_proj.weight)
            layer.shared_gate.weight.copy_(block.shared_expert_gate.weight)
    return layer


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = ((got - want).norm() / want.norm()).item()
    assert err < 1e-5, f"{what}: relative error {err:.2e}"


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "olmoe"])
def test_the_layer_equals_transformers_block_and_its_gradients(family):
    block = _hf_block(family)
    layer = _ours(family, block)
    x = torch.randn(3, 10, H, generator=torch.Generator().manual_seed(1))
    x_hf, x_ours = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = block(x_hf)
    got, stats = layer(x_ours)
    _close(got, want, f"{family} output")
    assert int(stats["tokens_per_expert"].sum()) == 30 * K
    want.square().sum().backward()
    got.square().sum().backward()
    _close(x_ours.grad, x_hf.grad, f"{family} input gradient")
    _close(layer.router.weight.grad, block.gate.weight.grad, f"{family} router gradient")
    _close(layer.experts.linear_fc1.grad, block.experts.gate_up_proj.grad, f"{family} fc1 gradient")
    _close(layer.experts.linear_fc2.grad, block.experts.down_proj.grad, f"{family} fc2 gradient")
    if family == "qwen2_moe":
        _close(layer.shared_gate.weight.grad, block.shared_expert_gate.weight.grad, "shared gate gradient")


def test_the_load_balancing_loss_is_megatrons_and_transformers_over_topk():
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
    cfg = MoEConfig(num_experts=E, ffn_hidden_size=F_EXPERT, topk=K, aux_loss_coeff=1.0)
    uniform = torch.zeros(40, E)
    assert aux_loss(uniform, cfg).item() == pytest.approx(1.0, rel=1e-6)  # whatever the ties pick
    logits = torch.randn(40, E, generator=torch.Generator().manual_seed(2))
    hf = load_balancing_loss_func((logits,), E, K)
    assert aux_loss(logits, cfg).item() == pytest.approx(hf.item() / K, rel=1e-6)
    sigmoid = MoEConfig(num_experts=E, ffn_hidden_size=F_EXPERT, topk=K, aux_loss_coeff=1.0,
                        score_function="sigmoid")
    assert aux_loss(uniform, sigmoid).item() == pytest.approx(1.0, rel=1e-6)


def test_the_sequence_load_balancing_loss_is_the_mean_of_each_sequences_loss():
    """Megatron's seq_aux_loss: each sequence's Switch loss on its own (its counts, S tokens), averaged; a (b, s)
    batch of b = 3 sequences, tokens in (b, s) order."""
    seq = MoEConfig(num_experts=E, ffn_hidden_size=F_EXPERT, topk=K, aux_loss_coeff=0.1,
                    load_balancing="seq_aux_loss")
    whole = MoEConfig(num_experts=E, ffn_hidden_size=F_EXPERT, topk=K, aux_loss_coeff=0.1)
    logits = torch.randn(3, 20, E, generator=torch.Generator().manual_seed(3))
    want = sum(aux_loss(logits[b], whole) for b in range(3)) / 3
    got = aux_loss(logits.reshape(-1, E), seq, sequences=3)
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    assert got.item() != pytest.approx(aux_loss(logits.reshape(-1, E), whole).item(), rel=1e-3)
    assert aux_loss(torch.zeros(60, E), seq, sequences=3).item() == pytest.approx(0.1, rel=1e-6)  # uniform


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_no_expert_keeps_more_than_its_capacity(policy):
    cfg = MoEConfig(num_experts=E, ffn_hidden_size=F_EXPERT, topk=K, capacity_factor=0.5,
                    drop_policy=policy)
    logits = torch.randn(64, E, generator=torch.Generator().manual_seed(3))
    logits[:, 0] += 3.0  # most tokens want expert 0
    probs, experts = route(logits, cfg)
    kept = drop_over_capacity(probs, experts, cfg)
    cap = capacity(64, cfg)
    assert cap == math.ceil(64 * K / E * 0.5) == 8
    counts = tokens_per_expert(kept, E)
    assert int(counts.max()) <= cap and int(counts[0]) == cap
    wanted = (experts == 0).any(dim=1).nonzero().flatten()
    kept0 = (kept == 0).any(dim=1).nonzero().flatten()
    if policy == "position":
        assert kept0.tolist() == wanted[:cap].tolist()
    else:
        p0 = probs[experts == 0]
        assert sorted(probs[kept == 0].tolist()) == sorted(torch.topk(p0, cap).values.tolist())


def test_a_capacity_that_drops_nothing_gives_the_dropless_bits():
    base = dict(num_experts=E, ffn_hidden_size=F_EXPERT, topk=K)
    torch.manual_seed(4)
    dropless = MoELayer(MoEConfig(**base), H)
    roomy = MoELayer(MoEConfig(**base, capacity_factor=float(E)), H)
    roomy.load_state_dict(dropless.state_dict())
    x = torch.randn(2, 12, H, generator=torch.Generator().manual_seed(5))
    assert torch.equal(dropless(x)[0], roomy(x)[0])


def test_sigmoid_routing_with_an_expert_bias_picks_by_the_bias_and_weighs_without_it():
    cfg = MoEConfig(num_experts=4, ffn_hidden_size=F_EXPERT, topk=2, score_function="sigmoid",
                    expert_bias=True)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    probs, experts = route(logits, cfg, bias=torch.tensor([0.0, 0.0, 0.0, 5.0]))
    assert experts.tolist() == [[3, 0]]
    scores = torch.sigmoid(logits)[0, [3, 0]]
    assert torch.allclose(probs[0], scores / scores.sum())


def test_an_expert_without_tokens_gets_no_gradient_and_the_rest_trains():
    torch.manual_seed(6)
    layer = MoELayer(MoEConfig(num_experts=E, ffn_hidden_size=F_EXPERT, topk=K), H)
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[:2] = 1.0  # every token routes to experts 0 and 1 (x > 0 below)
    x = torch.rand(2, 6, H) + 0.1
    out, stats = layer(x)
    assert stats["tokens_per_expert"].tolist() == [12, 12] + [0] * (E - 2)
    out.sum().backward()
    grad = layer.experts.linear_fc1.grad
    assert grad[:2].abs().sum() > 0 and torch.count_nonzero(grad[2:]) == 0


@pytest.mark.parametrize("fields, message", [
    (dict(topk=9), "--moe-router-topk 9 must be between 1 and --num-experts 8"),
    (dict(score_function="relu"), "--moe-router-score-function must be softmax or sigmoid, got 'relu'"),
    (dict(pre_softmax=True, score_function="sigmoid"), "--moe-router-pre-softmax needs --moe-router-score-function "
                                                       "softmax"),
    (dict(router_dtype="bf16"), "--moe-router-dtype must be fp32 or fp64, got 'bf16'"),
    (dict(capacity_factor=0.0), "--moe-expert-capacity-factor must be > 0, got 0.0"),
    (dict(drop_policy="random"), "--moe-token-drop-policy must be probs or position, got 'random'"),
    (dict(expert_bias=True), "--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid"),
    (dict(shared_gate=True), "--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size"),
    (dict(dispatcher="flex"), "--moe-token-dispatcher-type must be allgather or alltoall, got 'flex'"),
])
def test_bad_settings_are_one_line(fields, message):
    with pytest.raises(ValueError) as err:
        MoEConfig(**{**dict(num_experts=E, ffn_hidden_size=F_EXPERT), **fields})
    assert "\n" not in str(err.value) and str(err.value).startswith(message), str(err.value)
