"""LR schedule against hand-computed values; FLOP formula against Megatron's closed form."""
import math

import pytest
import torch

from megatron.model.config import T5Config
from megatron.model.flops import gpt_flops_per_iteration, t5_flops_per_iteration
from megatron.model.specs import spec_for
from megatron.training.learning_rates import AnnealingLR, annealed_lr


@pytest.mark.parametrize("style, n, expected", [
    ("linear", 0, 0.0), ("linear", 5, 0.5), ("linear", 10, 1.0), ("linear", 55, 0.1 + 0.9 * 0.5),
    ("linear", 100, 0.1), ("linear", 150, 0.1),
    ("cosine", 55, 0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.5) + 1)), ("cosine", 100, 0.1),
    ("cosine", 32.5, 0.1 + 0.9 * 0.5 * (math.cos(math.pi * 0.25) + 1)),
    ("constant", 5, 0.5), ("constant", 1000, 1.0),
])
def test_annealed_lr(style, n, expected):
    assert annealed_lr(n, 1.0, 0.1, 10, 100, style) == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_scheduler_sets_groups_and_resumes():
    params = [torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2, 2))]
    opt = torch.optim.AdamW([{"params": params[:1]}, {"params": params[1:]}], lr=1.0)
    sched = AnnealingLR(opt, 1.0, 0.0, 4, 20, "cosine")
    for _ in range(7):
        sched.step()
    assert [g["lr"] for g in opt.param_groups] == [annealed_lr(7, 1.0, 0.0, 4, 20, "cosine")] * 2
    fresh = AnnealingLR(opt, 1.0, 0.0, 4, 20, "cosine")
    fresh.load_state_dict(sched.state_dict())
    assert fresh.get_lr() == sched.get_lr() and fresh.num_steps == 7


def test_gpt_flops_match_megatron_formula():
    b, s, L, h, V = 8, 1024, 24, 2048, 51200
    megatron_recompute = 96 * b * s * L * h * h * (1 + s / (6 * h) + V / (16 * L * h))
    assert gpt_flops_per_iteration(b, s, L, h, h, 4 * h, V, recompute=True) == pytest.approx(megatron_recompute)
    no_recompute = 72 * b * s * L * h * h * (1 + s / (6 * h)) + 6 * b * s * h * V
    assert gpt_flops_per_iteration(b, s, L, h, h, 4 * h, V, recompute=False) == pytest.approx(no_recompute)


def test_t5_flops_decoder_adds_cross_attention():
    b, s, L, h, V = 2, 64, 2, 32, 100
    gpt_like = t5_flops_per_iteration(b, s, s, L, h, h, 4 * h, V, recompute=False)
    # encoder + decoder self-attention layers = a 2L-layer GPT; cross-attention with s_e = s adds 8bsh^2 + 4bs^2h (Q 2, KV 4, output 2)
    cross = 3 * L * (8 * b * s * h * h + 4 * b * s * s * h)
    assert gpt_like == pytest.approx(gpt_flops_per_iteration(b, s, 2 * L, h, h, 4 * h, V, False) + cross)


def test_t5_flops_gated_gelu_counts_both_input_projections():
    b, s, L, h, f, V = 2, 64, 2, 32, 80, 100
    relu = t5_flops_per_iteration(b, s, s, L, h, h, f, V, recompute=False)
    gated = t5_flops_per_iteration(b, s, s, L, h, h, f, V, recompute=False, gated=True)
    # one more h x f projection per layer, 2L layers, forward + backward
    assert gated - relu == pytest.approx(3 * 2 * L * 2 * b * s * h * f)
    model = T5Config(num_layers=L, hidden_size=h, num_attention_heads=4, vocab_size=V, seq_length=s, ffn_hidden_size=f,
                     feed_forward_proj="gated-gelu")
    assert spec_for("t5").flops(model, b, V) == pytest.approx(gated)


def test_gpt_flops_grouped_query_attention_and_swiglu_by_hand():
    """B = 2, s = 8, h = 64, a = 4 heads of 16, G = 2 key/value groups, SwiGLU f = 128, V = 128, one layer."""
    from megatron.model.config import GPTConfig
    qkv = 2 * 2 * 8 * 64 * (4 + 2 * 2) * 16        # 2 B s h (a + 2G) kv_channels = 262144
    scores_values = 2 * (2 * 2 * 8 * 8 * 64)        # QK^T and weighted values over every query head: 32768
    dense = 2 * 2 * 8 * 64 * 64                     # 131072
    swiglu = 6 * 2 * 8 * 64 * 128                   # gate, up and down projections: 786432
    logits = 2 * 2 * 8 * 64 * 128                   # 262144
    expected = 3 * (qkv + scores_values + dense + swiglu) + 3 * logits
    assert expected == 4423680
    assert gpt_flops_per_iteration(2, 8, 1, 64, 64, 128, 128, recompute=False, d_kv=32, gated=True) == expected
    llama = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=8, swiglu=True,
                       num_query_groups=2, position_embedding_type="rope", normalization="RMSNorm",
                       add_bias_linear=False, tie_word_embeddings=False)
    assert llama.ffn_hidden_size == 128
    assert spec_for("gpt").flops(llama, 2, 128) == expected
    gpt2 = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=100, seq_length=8)
    assert spec_for("gpt").flops(gpt2, 2, 128) == gpt_flops_per_iteration(2, 8, 1, 64, 64, 256, 128, False)
