"""Recomputation: Megatron's --recompute-granularity full|selective, --recompute-method uniform|block,
--recompute-num-layers N, with --checkpoint-activations / --checkpoint-num-layers as aliases.

- Plain models, dropout on: selective, full uniform and full block give bit-identical losses and gradients to no
  recomputation (dropout replayed).
- Selective keeps the s^2 attention tensors out of the saved activations where SDPA stores them (CPU, attention
  dropout on): saved bytes drop by at least the (b, n, s, s) probabilities; with SDPA's fused kernel (no
  dropout) it saves nothing, as `--help` says; where SDPA reports a fused kernel (GPUs) the core is not
  checkpointed at all.
- Pipe models at pp = 2, dropout on: selective and full block equal the single process (fp32 < 1e-5), and
  block marks the first N transformer layers of each stage.
- The flags resolve as Megatron's, the aliases included; a method without full granularity is an error.
"""
from __future__ import annotations

import pytest
import torch

from harness.dist import run_distributed
from tests.model import common

DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
MODES = {"selective": dict(recompute_granularity="selective"),
         "uniform-2": dict(checkpoint_num_layers=2),
         "block-1": dict(checkpoint_num_layers=1, recompute_method="block")}


def _loss_and_grads(kind: str, **kw):
    cfg = common.make_config(kind, **DROPOUT, **kw)
    model = common.build_plain(kind, cfg)
    for micro in common.make_batches(kind, cfg, 1, 2 * common.MBS)[0]:
        loss = common.micro_loss(model, micro)
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
def test_recomputation_keeps_losses_and_gradients(kind):
    loss, grads = _loss_and_grads(kind)
    for mode, kw in MODES.items():
        got_loss, got = _loss_and_grads(kind, **kw)
        assert torch.equal(loss, got_loss), f"{mode}: loss {got_loss} vs {loss}"
        for name, g in grads.items():
            assert torch.equal(g, got[name]), f"{mode}: gradient of {name} differs"


def saved_bytes(fn) -> int:
    """Bytes of the distinct storages autograd saves while `fn` runs (saved-tensor hooks)."""
    seen, total = set(), [0]

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total[0] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return total[0]


@pytest.mark.parametrize("attention_dropout", [0.1, 0.0])
def test_selective_drops_the_attention_scores(attention_dropout):
    from megatron.model.transformer import TransformerLayer
    b, s, h, n = 2, 64, 32, 4

    def layer_bytes(granularity):
        cfg = common.gpt2_config(seq_length=s, hidden_size=h, num_attention_heads=n, hidden_dropout=0.1,
                                 attention_dropout=attention_dropout, recompute_granularity=granularity)
        layer = TransformerLayer(cfg, 1)
        x = torch.randn(b, s, h, requires_grad=True)
        return saved_bytes(lambda: layer(x))

    full, selective = layer_bytes(None), layer_bytes("selective")
    if attention_dropout:
        assert full - selective >= b * n * s * s * 4, (full, selective)  # at least the fp32 probabilities
    else:
        assert full - selective < b * n * s * s, (full, selective)  # the fused kernel stored no s^2 tensor


def test_selective_leaves_a_fused_kernel_core_alone(monkeypatch):
    """Where SDPA reports a fused kernel (a GPU) the core is not checkpointed: it stores no s^2 tensor, and a
    recomputed flash forward only costs time. The decision is SDPA's own (`_fused_kernel`); here it is forced."""
    from megatron.model import attention
    from megatron.model.transformer import TransformerLayer
    b, s, h, n = 2, 64, 32, 4
    cfg = common.gpt2_config(seq_length=s, hidden_size=h, num_attention_heads=n, hidden_dropout=0.1,
                             attention_dropout=0.1, recompute_granularity="selective")
    layer, x = TransformerLayer(cfg, 1), torch.randn(b, s, h, requires_grad=True)
    checkpointed = []
    real = attention.replay_checkpoint
    monkeypatch.setattr(attention, "replay_checkpoint", lambda *a: checkpointed.append(1) or real(*a))
    layer(x)
    assert checkpointed == [1]  # CPU, attention dropout on: SDPA's kernel would keep the s^2 tensors
    assert not attention._fused_kernel(layer.self_attention.attention_dropout, x, x, x, None)  # CPU: never
    monkeypatch.setattr(attention, "_fused_kernel", lambda *a: True)
    layer(x)
    assert checkpointed == [1]


def _pipe_jobs() -> list:
    return [dict(kind=k, tp=1, pp=2, dp=1, config_kw={**DROPOUT, **MODES[m]}, steps=2)
            for k in ("gpt2", "t5") for m in ("selective", "block-1")]


def _marked(kind: str) -> list:
    """Per stage of a pp = 2 build with block recomputation of 1 layer: which transformer layers recompute."""
    import torch.distributed as dist

    import tds
    from megatron import mpu
    from megatron.model.gpt2_pipe import GPT2ModelPipe
    from megatron.model.t5_pipe import T5ModelPipe
    from megatron.model.transformer import T5TransformerLayer, TransformerLayer
    tds.init_distributed(dist_backend="gloo")
    mpu.initialize_model_parallel(1, 2)
    cls, layer_type = (GPT2ModelPipe, TransformerLayer) if kind == "gpt2" else (T5ModelPipe, T5TransformerLayer)
    model = cls(common.make_config(kind, checkpoint_num_layers=1, recompute_method="block"))
    marks = [getattr(m, "recompute_whole", False) for m in model.modules() if isinstance(m, layer_type)]
    mpu.destroy_model_parallel()
    dist.barrier()
    return marks


def test_pipe_selective_and_block_match_single_process():
    jobs = _pipe_jobs()
    per_rank = run_distributed(common.run_jobs, 2, jobs, timeout=500)
    for j, job in enumerate(jobs):
        cfg = common.make_config(job["kind"], **job["config_kw"])
        ref = common.reference_run(job["kind"], cfg, common.make_batches(job["kind"], cfg, 2, common.MBS * common.GAS))
        results = [r[j] for r in per_rank]
        for r in results:
            for got, want in zip(r["losses"], ref["losses"]):
                assert abs(got - want) <= 1e-5 * abs(want), (job, r["losses"], ref["losses"])
        common.check_grads(results, ref["grads"], 1, 1e-5)
    assert run_distributed(_marked, 2, "gpt2") == [[True, False], [True, False]]  # 4 layers: 2 per stage


def _resolve(*flags: str):
    import argparse

    from megatron.config.resolution import _resolve_recompute
    args = argparse.Namespace(checkpoint_activations=False, checkpoint_num_layers=None, recompute_granularity=None,
                              recompute_method=None, recompute_num_layers=None)
    for flag in flags:
        name, _, value = flag.partition("=")
        setattr(args, name, True if value == "" else (int(value) if value.isdigit() else value))
    _resolve_recompute(args)
    return args.recompute_granularity, args.recompute_method, args.recompute_num_layers, args.checkpoint_activations


def test_flags_and_aliases_resolve():
    from megatron.errors import UserError
    from megatron.model.specs.common import recompute_fields
    assert _resolve() == (None, "uniform", 1, False)
    assert _resolve("checkpoint_activations", "checkpoint_num_layers=2") == ("full", "uniform", 2, True)
    assert _resolve("recompute_granularity=full", "recompute_method=block", "recompute_num_layers=3") == \
        ("full", "block", 3, True)
    assert _resolve("recompute_granularity=selective") == ("selective", "uniform", 1, False)
    with pytest.raises(UserError, match="--recompute-method block applies to --recompute-granularity full"):
        _resolve("recompute_granularity=selective", "recompute_method=block")
    with pytest.raises(UserError, match="disagree"):
        _resolve("recompute_num_layers=2", "checkpoint_num_layers=3")
    import argparse
    old = argparse.Namespace(checkpoint_activations=True, checkpoint_num_layers=2)  # a record without the new flags
    assert recompute_fields(old) == dict(recompute_granularity="full", checkpoint_num_layers=2, recompute_method="uniform")
