"""Single-process checks of the architectures against independent reimplementations, and of the pieces:
vocabulary padding (padded ids take no probability mass), T5 relative position buckets and the compact
bias, SDPA paths, config and head-split errors."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.model.attention import check_heads
from megatron.model.config import GPT2Config, T5Config, padded_vocab_size
from megatron.model.gpt2_model import GPT2Model
from megatron.model.position import RelativePositionBias, expand_compact_bias, relative_position_bucket
from megatron.model.t5_model import T5Model
from tests.model import common, reference_impl

TOL = 1e-5


def _rel(a, b):
    return common.rel_err(a, b)


def test_gpt2_matches_reference_implementation():
    cfg = common.gpt2_config(num_layers=2)
    model = GPT2Model(cfg).eval()
    (tokens, positions), _ = common.gpt2_batch(cfg, 2, torch.Generator().manual_seed(1))
    mask = torch.ones(16, 16, dtype=torch.bool).triu(1)  # the causal mask, explicit
    got = model(tokens, positions, mask)[..., :cfg.vocab_size]
    want = reference_impl.gpt2_logits(model.state_dict(), cfg, tokens)
    assert _rel(got, want) < TOL
    assert _rel(model(tokens)[..., :cfg.vocab_size], want) < TOL  # mask=None: is_causal path


@pytest.mark.parametrize("ff", ["relu", "gated-gelu"])
def test_t5_matches_reference_implementation(ff):
    cfg = common.t5_config(feed_forward_proj=ff, num_decoder_layers=3)
    model = T5Model(cfg).eval()
    inputs, _ = common.t5_batch(cfg, 2, torch.Generator().manual_seed(2))
    got = model(*inputs)[..., :cfg.vocab_size]
    want = reference_impl.t5_logits(model.state_dict(), cfg, *inputs)
    assert _rel(got, want) < TOL


def test_only_first_layer_of_each_stack_owns_position_bias():
    model = T5Model(common.t5_config(num_layers=3, num_decoder_layers=2))
    owners = [name for name, _ in model.named_parameters() if "relative_attention_bias" in name]
    assert owners == ["encoder_layers.0.self_attention.relative_attention_bias.weight",
                      "decoder_layers.0.self_attention.relative_attention_bias.weight"]
    assert not any(p.ndim == 1 and "bias" in n and "layernorm" not in n for n, p in model.named_parameters())


def test_padded_vocab_size():
    assert padded_vocab_size(50257, 128, 1) == 50304
    assert padded_vocab_size(50257, 128, 2) == 50432
    assert padded_vocab_size(256, 128, 2) == 256
    assert padded_vocab_size(257, 128, 2) == 512
    with pytest.raises(ValueError, match="tp=0"):
        padded_vocab_size(100, 128, 0)


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
def test_padded_ids_take_no_probability_mass(kind):
    cfg = common.make_config(kind)
    model = common.build_plain(kind, cfg)
    g = torch.Generator().manual_seed(3)
    inputs, (labels, loss_mask) = (common.gpt2_batch if kind == "gpt2" else common.t5_batch)(cfg, 2, g)
    logits = model(*inputs)  # (b, s, 384): 300 real ids + 84 padded
    v = cfg.vocab_size
    assert logits.shape[-1] == padded_vocab_size(v, 128, 1) > v
    probs = torch.softmax(logits.float(), dim=-1)
    assert probs[..., v:].max().item() == 0.0
    assert torch.allclose(probs[..., :v].sum(-1), torch.ones(()), atol=1e-6)
    logits.retain_grad()
    loss = model.loss(logits, labels, torch.ones_like(loss_mask))
    want = F.cross_entropy(logits[..., :v].float().reshape(-1, v), labels.reshape(-1))
    assert _rel(loss, want) < TOL
    loss.backward()
    assert logits.grad[..., v:].abs().max().item() == 0.0
    assert model.embedding.word_embeddings.weight.grad[v:].abs().max().item() == 0.0


def test_loss_mask_weights_positions():
    cfg = common.gpt2_config(num_layers=1)
    model = GPT2Model(cfg)
    (tokens, positions), (labels, loss_mask) = common.gpt2_batch(cfg, 2, torch.Generator().manual_seed(4))
    logits = model(tokens, positions)
    per_token = F.cross_entropy(logits[..., :cfg.vocab_size].reshape(-1, cfg.vocab_size), labels.reshape(-1),
                                reduction="none")
    want = (per_token * loss_mask.reshape(-1)).sum() / loss_mask.sum()
    assert _rel(model.loss(logits, labels, loss_mask), want) < TOL


@pytest.mark.parametrize("bidirectional,buckets,max_distance", [(True, 32, 128), (False, 32, 128), (True, 8, 16)])
def test_relative_position_bucket_matches_mesh_tensorflow(bidirectional, buckets, max_distance):
    distances = torch.arange(-300, 301)
    got = relative_position_bucket(distances, bidirectional, buckets, max_distance).tolist()
    want = [reference_impl.t5_bucket(d, bidirectional, buckets, max_distance) for d in distances.tolist()]
    assert got == want


def test_compact_bias_expands_to_full_bias():
    table = RelativePositionBias(4, 8, 16, bidirectional=False, init_std=1.0)
    q, k = 5, 7
    full = expand_compact_bias(table.compact(q, k), q, k)  # (1, n, q, k)
    i, j = torch.arange(q)[:, None], torch.arange(k)[None, :]
    direct = table.weight[relative_position_bucket(j - i, False, 8, 16)].permute(2, 0, 1).unsqueeze(0)
    assert torch.equal(full, direct)


def test_head_split_error_names_heads_and_tp():
    assert check_heads(8, 4) == 2
    with pytest.raises(ValueError, match=r"num_attention_heads \(6\).*tensor-model-parallel size \(4\)"):
        check_heads(6, 4)


def test_config_errors_and_defaults():
    cfg = GPT2Config(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=500, seq_length=32)
    assert (cfg.ffn_hidden_size, cfg.kv_channels, cfg.max_position_embeddings) == (256, 16, 32)
    with pytest.raises(ValueError, match="hidden_size .30. is not divisible by num_attention_heads .4."):
        GPT2Config(num_layers=2, hidden_size=30, num_attention_heads=4, vocab_size=500, seq_length=32)
    with pytest.raises(ValueError, match="feed_forward_proj"):
        T5Config(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=500, seq_length=32,
                 feed_forward_proj="swiglu")
    t5 = T5Config(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=500, seq_length=32)
    assert (t5.num_decoder_layers, t5.decoder_seq_length, t5.layernorm_epsilon) == (2, 32, 1e-6)


def test_same_seed_same_weights_and_modules_independent_of_build_order():
    cfg = common.t5_config()
    a = T5Model(cfg)
    torch.manual_seed(999)  # the global generator must not matter
    b = T5Model(cfg)
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb and torch.equal(pa, pb)
