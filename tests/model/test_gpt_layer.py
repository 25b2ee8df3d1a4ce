"""The Llama-family GPT layer (rotary positions, RMSNorm, SwiGLU, grouped-query attention, no biases, untied head)
on the TDS engine equals the single-process plain model: per-step losses, first-step gradients and the eval loss
(fp32, relative error < 1e-5), with hidden and attention dropout on, at

    (tp, pp, dp) = (2, 1, 1) (query groups split over tp, and with --sequence-parallel),
                   (1, 2, 1) with each schedule (1F1B, GPipe, interleaved, ZB-H1),
                   (1, 1, 2) ZeRO-1 (replica r draws the masks of the single process's micro-batches it holds),
                   (2, 2, 2) ZeRO-1 with sequence parallelism and selective recomputation (long),
and a Qwen2-style variant (qkv bias only, tied head, one group per head, half the channels rotated, llama3 rope
scaling) at (2, 2, 1) with full recomputation; Qwen3's layer (the Llama layer with --qk-layernorm and heads of
width 12, not h / a) and OLMo-2's (the Llama layer with --qk-layernorm-full and --post-sublayer-norm) at tp 2 with
sequence parallelism (Qwen3's with selective, OLMo-2's with full recomputation): Qwen3's norm weights are
replicated over tp, each rank normalising its own heads, OLMo-2's are split with the heads and their statistics
all-reduced, and every rank's gradients are compared with its part of the single process's (their other layouts
and schedules: tests/training/test_norm_options_pretrain.py, long). Plus the parts on their own: the block-strided QKV partition,
rotary positions against their definition, the query / key norms and the reordered layer against their
definitions, and the config's one-line errors.
"""
from __future__ import annotations

import math

import pytest
import torch

from harness.dist import run_distributed
from tests.model import common

STEPS = 3
TOL = 1e-5
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
LLAMA = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=2,
             add_bias_linear=False, tie_word_embeddings=False, **DROPOUT)
QWEN = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
            add_qkv_bias=True, rotary_percent=0.5, rope_scaling_factor=4.0, rope_original_max_positions=8,
            checkpoint_num_layers=1, **DROPOUT)


QWEN3 = dict(LLAMA, qk_layernorm=True, kv_channels=12)
OLMO2 = dict(LLAMA, qk_layernorm_full=True, post_sublayer_norm=True)


def _job(tp, pp, dp, config_kw=LLAMA, schedule="1f1b", **kw):
    v = 2 if schedule == "interleaved" else 1
    return dict(kind="gpt2", tp=tp, pp=pp, dp=dp, config_kw=config_kw, steps=STEPS, gas=4, schedule=schedule,
                virtual_stages=v, zero=1 if dp > 1 else 0, **kw)


def _check(jobs, per_rank):
    references = {}
    for j, job in enumerate(jobs):
        key = (tuple(sorted(job["config_kw"].items())), job["dp"] * job["gas"])  # the global batch differs
        if key not in references:
            config = common.make_config("gpt2", **job["config_kw"])
            batches = common.make_batches("gpt2", config, STEPS, common.MBS * job["gas"] * job["dp"])
            references[key] = common.reference_run("gpt2", config, batches)
        ref, results = references[key], [r[j] for r in per_rank]
        where = {k: v for k, v in job.items() if k != "config_kw"}
        for r in results:
            for step, (got, want) in enumerate(zip(r["losses"], ref["losses"])):
                assert abs(got - want) <= TOL * abs(want), f"{where}: step {step} loss {got} vs plain {want}"
            assert abs(r["eval_loss"] - ref["eval_loss"]) <= TOL * abs(ref["eval_loss"]), f"{where}: eval loss"
        if job["zero"] == 0:  # ZeRO-1 keeps the gradients in DeepSpeed's flat partitions
            assert common.check_grads(results, ref["grads"], job["tp"], TOL) == len(ref["grads"])


def test_llama_layer_at_world_size_two():
    jobs = [_job(2, 1, 1), _job(2, 1, 1, sequence_parallel=True), _job(1, 1, 2),
            *(_job(1, 2, 1, schedule=s) for s in ("1f1b", "gpipe", "interleaved", "zb-h1"))]
    _check(jobs, run_distributed(common.run_jobs, 2, jobs, timeout=600))


def test_qwen_style_variant_at_tp2_pp2():
    jobs = [_job(2, 2, 1, config_kw=QWEN)]
    _check(jobs, run_distributed(common.run_jobs, 4, jobs, timeout=600))


def test_qwen3_and_olmo2_layers_at_tp2_with_sequence_parallelism():
    jobs = [_job(2, 1, 1, config_kw=dict(QWEN3, recompute_granularity="selective"), sequence_parallel=True),
            _job(2, 1, 1, config_kw=dict(OLMO2, checkpoint_num_layers=1), sequence_parallel=True)]
    _check(jobs, run_distributed(common.run_jobs, 2, jobs, timeout=600))


@pytest.mark.long
def test_llama_layer_3d_zero1_sequence_parallel_selective():
    jobs = [_job(2, 2, 2, config_kw=dict(LLAMA, recompute_granularity="selective"), sequence_parallel=True)]
    _check(jobs, run_distributed(common.run_jobs, 8, jobs, timeout=900))


def test_grouped_qkv_partition_keeps_each_ranks_heads_and_groups():
    """[Q; K; V] with 4 query heads and 2 groups of width 3: tp rank r holds the queries of heads 2r, 2r+1 and
    the keys and values of group r; merging the parts gives the master back."""
    from megatron.mpu.utils import merge_partitions, partition_master
    d = 3
    master = torch.arange((4 + 2 + 2) * d, dtype=torch.float32).unsqueeze(1)  # rows: q0 q1 q2 q3 k0 k1 v0 v1
    parts = partition_master(master, 0, (4, 2, 2), 2)
    rows = lambda *blocks: torch.cat([master[b * d:(b + 1) * d] for b in blocks])  # noqa: E731
    assert torch.equal(parts[0], rows(0, 1, 4, 6)) and torch.equal(parts[1], rows(2, 3, 5, 7))
    assert torch.equal(merge_partitions(parts, 0, (4, 2, 2)), master)
    assert torch.equal(torch.cat(partition_master(master, 0, 3, 2)), torch.cat(partition_master(master, 0, (1, 1, 1), 2)))
    with pytest.raises(ValueError, match=r"relative sizes \[4, 1, 1\].*tensor-model-parallel size 2"):
        partition_master(master[:6 * d], 0, (4, 1, 1), 2)


def test_rotary_positions_follow_their_definition():
    """x' = x cos(p theta) + rotate_half(x) sin(p theta) on the first r channels, the rest untouched; a query
    and a key rotated at positions p and p + k give the score they give at 0 and k (relative positions)."""
    from megatron.model.position import RotaryEmbedding, rotary_inverse_frequencies
    r, d, base = 4, 6, 100.0
    rope = RotaryEmbedding(r, base)
    x = torch.randn(1, 1, 5, d, dtype=torch.float64)
    out = rope(x, start=3)
    theta = [base ** (-2 * i / r) for i in range(r // 2)]
    for s in range(5):
        p = 3 + s
        for i, t in enumerate(theta):
            a, b = x[0, 0, s, i].item(), x[0, 0, s, i + r // 2].item()
            assert math.isclose(out[0, 0, s, i].item(), a * math.cos(p * t) - b * math.sin(p * t), abs_tol=1e-6)
            assert math.isclose(out[0, 0, s, i + r // 2].item(), b * math.cos(p * t) + a * math.sin(p * t),
                                abs_tol=1e-6)
    assert torch.equal(out[..., r:], x[..., r:])
    q, k = torch.randn(1, 1, 1, d), torch.randn(1, 1, 1, d)
    near = (rope(q, 0) * rope(k, 2)).sum()
    far = (rope(q, 40) * rope(k, 42)).sum()
    assert torch.allclose(near, far, atol=1e-5)
    # llama3 scaling over wavelengths 2 pi / theta = 6.3, 29, 135 with original 64: kept below 64 / 4, divided by
    # the factor above 64 / 1, interpolated between
    plain = rotary_inverse_frequencies(6, base)
    scaled = rotary_inverse_frequencies(6, base, dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                      original_max_positions=64))
    assert scaled[0] == plain[0] and torch.isclose(scaled[2], plain[2] / 8)
    assert plain[1] / 8 < scaled[1] < plain[1]


@pytest.mark.parametrize("normalization", ["RMSNorm", "LayerNorm"])
def test_query_key_norm_normalises_each_head_with_one_weight(normalization):
    """--qk-layernorm: every head of (b, n, s, d) is normalised over its own d channels, with one weight (and bias)
    for all heads, and the result keeps the layout of the head-split view it is given."""
    from megatron.model.layer_norm import HeadNorm
    d = 6
    norm = HeadNorm(normalization, d, 1e-5, torch.float32)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(d))
        if norm.bias is not None:
            norm.bias.copy_(torch.randn(d))
    x = torch.randn(2, 5, 3 * d).view(2, 5, 3, d).transpose(1, 2)  # (b, n, s, d) as attention splits heads
    got = norm(x)
    centred = x if normalization == "RMSNorm" else x - x.mean(-1, keepdim=True)
    want = centred / (centred.pow(2).mean(-1, keepdim=True) + 1e-5).sqrt() * norm.weight
    if norm.bias is not None:
        want = want + norm.bias
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got.stride() == x.stride()


def test_projection_norm_normalises_all_heads_together():
    """--qk-layernorm-full: RMSNorm over a token's n d channels of all heads at once, a weight per channel, given
    (b, n, s, d) as attention splits heads (OLMo-2's q_norm over the (b, s, n d) projection)."""
    from megatron.model.layer_norm import ProjectionRMSNorm
    n, d = 3, 4
    norm = ProjectionRMSNorm(n * d, n, 1e-6, torch.float32)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(n * d))
    projection = torch.randn(2, 5, n * d)  # (b, s, n d)
    got = norm(projection.view(2, 5, n, d).transpose(1, 2)).transpose(1, 2).reshape(2, 5, n * d)
    want = projection / (projection.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * norm.weight
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_post_sublayer_norm_layer_follows_its_definition():
    """--post-sublayer-norm: h = x + N1(attn(x)), out = h + N2(mlp(h)) (dropout off); the same attention and MLP
    weights as the pre-norm layer built from the same seed."""
    from megatron.model.transformer import TransformerLayer
    config = common.gpt2_config(**dict(OLMO2, hidden_dropout=0.0, attention_dropout=0.0))
    layer = TransformerLayer(config, 1).eval()
    assert not hasattr(layer, "input_layernorm")
    with torch.no_grad():
        for norm in (layer.post_self_attn_layernorm, layer.post_mlp_layernorm):
            norm.weight.copy_(torch.randn(norm.weight.shape))
        x = torch.randn(2, config.seq_length, config.hidden_size)
        h = x + layer.post_self_attn_layernorm(layer.self_attention(x, None))
        torch.testing.assert_close(layer(x), h + layer.post_mlp_layernorm(layer.mlp(h)), rtol=0, atol=0)
    pre = TransformerLayer(common.gpt2_config(**dict(OLMO2, post_sublayer_norm=False)), 1)
    same = dict(pre.named_parameters())
    for name, p in layer.named_parameters():
        assert "layernorm" in name.split(".")[0] or torch.equal(p, same[name]), name


@pytest.mark.parametrize("kw, words", [
    (dict(num_query_groups=3), "num_query_groups (3) must divide num_attention_heads (4)"),
    (dict(position_embedding_type="alibi"), "position_embedding_type must be one of"),
    (dict(normalization="ScaleNorm"), "normalization must be one of"),
    (dict(position_embedding_type="rope", rotary_percent=0.3), "rotary_percent 0.3 of kv_channels 8"),
    (dict(qk_layernorm=True, qk_layernorm_full=True, normalization="RMSNorm"), "exclude each other"),
    (dict(qk_layernorm_full=True), "qk_layernorm_full is an RMSNorm; normalization is 'LayerNorm'"),
])
def test_config_refuses_what_cannot_be_built(kw, words):
    with pytest.raises(ValueError, match=words.replace("(", r"\(").replace(")", r"\)")):
        common.gpt2_config(**kw)


def test_groups_that_tp_does_not_divide_are_refused():
    from megatron.model.attention import check_groups
    with pytest.raises(ValueError, match=r"num_query_groups \(2\) is not divisible by the tensor-model-parallel "
                                         r"size \(4\)"):
        check_groups(2, 4)
