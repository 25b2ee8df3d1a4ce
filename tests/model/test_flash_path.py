"""The flash path: with the default data (no --reset-attention-mask) GPT-2 hands the attention core
(`attention.attention_core`) is_causal=True and no mask, and the core hands them to scaled_dot_product_attention;
the batch carries no mask tensor and none crosses a pipeline boundary; with --reset-attention-mask the mask is
built, declared at the boundary and passed to SDPA.

SDPA and the core are patched (wrappers that record what they receive and call the real ones), so the test holds
on CPU, where the core computes attention with dropout itself (SDPA's CPU flash kernel takes no dropout) and
calls SDPA without it.
"""
from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from megatron.model import attention
from megatron.model.specs import spec_for
from tests.model import common


@pytest.fixture
def sdpa_calls(monkeypatch):
    calls = []
    real = F.scaled_dot_product_attention

    def recording(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, **kw):
        calls.append(dict(attn_mask=attn_mask, is_causal=is_causal, dropout_p=dropout_p))
        return real(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    return calls


def _data_args(reset_attention_mask: bool):
    return types.SimpleNamespace(reset_position_ids=False, reset_attention_mask=reset_attention_mask,
                                 eod_mask_loss=False)


def _raw(s: int = 16) -> dict:
    return {"text": torch.randint(1, 300, (2, s + 1), generator=torch.Generator().manual_seed(0))}


def test_default_data_builds_no_mask_and_sdpa_gets_is_causal(sdpa_calls, monkeypatch):
    core_calls = []
    real_core = attention.attention_core

    def recording_core(q, k, v, mask, drop, scale=None, is_causal=False, explicit=False):
        core_calls.append(dict(attn_mask=mask, is_causal=is_causal, dropout_p=drop.p if drop.active else 0.0))
        return real_core(q, k, v, mask, drop, scale, is_causal, explicit)

    monkeypatch.setattr(attention, "attention_core", recording_core)
    inputs, _ = spec_for("gpt").get_batch(_raw(), _data_args(False), types.SimpleNamespace(eod=0))
    assert len(inputs) == 2 and all(t.dtype == torch.int64 for t in inputs)  # tokens, position ids: no mask
    cfg = common.gpt2_config(num_layers=2, hidden_dropout=0.1, attention_dropout=0.1)
    model = common.build_plain("gpt2", cfg)
    model(*inputs).sum().backward()  # training: the core gets dropout 0.1 (on CPU it computes it itself)
    model.eval()
    with torch.no_grad():
        model(*inputs)  # evaluation: no dropout, the core calls SDPA
    assert len(core_calls) == 4 and len(sdpa_calls) == 2
    assert all(c["attn_mask"] is None and c["is_causal"] for c in core_calls + sdpa_calls)
    assert [c["dropout_p"] for c in core_calls] == [0.1, 0.1, 0.0, 0.0]


def test_reset_attention_mask_keeps_the_mask_path(sdpa_calls):
    raw = _raw()
    raw["text"][:, 5] = 0  # an EOD in every row
    inputs, _ = spec_for("gpt").get_batch(raw, _data_args(True), types.SimpleNamespace(eod=0))
    tokens, positions, mask = inputs
    assert mask.shape == (2, 1, 16, 16) and mask.dtype == torch.bool
    cfg = common.gpt2_config(num_layers=1, explicit_attention_mask=True)
    common.build_plain("gpt2", cfg)(*inputs)
    (call,) = sdpa_calls
    assert not call["is_causal"] and torch.equal(call["attn_mask"], ~mask)


def test_pipe_declares_no_mask_at_the_boundary():
    from harness.dist import run_distributed
    for without, with_mask in run_distributed(_declarations, 2, timeout=120):
        assert without == ([True], ["float"], [True])
        assert with_mask == ([True, False], ["float", "bool"], [True, False])


def _declarations() -> tuple:
    """Rank-local: the boundary declarations of a pp = 2 GPT2ModelPipe without, then with, an explicit mask;
    and one training batch through the engine without a mask (nothing but the hidden state crosses)."""
    import torch.distributed as dist

    import tds
    from megatron import mpu
    from megatron.model.gpt2_pipe import GPT2ModelPipe
    tds.init_distributed(dist_backend="gloo")
    mpu.initialize_model_parallel(1, 2)
    out = []
    for explicit in (False, True):
        cfg = common.gpt2_config(explicit_attention_mask=explicit)
        model = GPT2ModelPipe(cfg)
        out.append((list(model._input_grad), list(model._input_type), list(model._input_pipe_partitioned)))
    cfg = common.gpt2_config()
    model = GPT2ModelPipe(cfg)
    engine, _, _, _ = tds.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                     config=common.ds_config(1), mpu=mpu)
    engine.train_batch(iter(common.make_batches("gpt2", cfg, 1, common.MBS * common.GAS)[0]))
    mpu.destroy_model_parallel()
    dist.barrier()
    return out
