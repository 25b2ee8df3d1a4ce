"""Dropout that does not depend on the layout, and activation checkpointing that does not change gradients.

- Plain model, dropout on: checkpointing every 1 or 2 layers gives bit-identical loss and gradients to no
  checkpointing (the recomputation replays the dropout masks), over two micro-batches.
- Dropout on: the TDS pipeline at (tp, pp, dp) = (1,1,1) and (1,2,1), the latter also with activation
  checkpointing, equals the single-process plain model step for step (fp32, rel err < 1e-5).
- Dropout is active, draws fresh masks per call, and a mask is a function of (iteration, micro-batch) only:
  a fresh model told the iteration draws the masks of a model that got there by training (so resuming
  needs no saved dropout state); evaluation counts no call; no other random stream moves.
"""
from __future__ import annotations

import pytest
import torch

from harness.dist import run_distributed
from tests.model import common

DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
STEPS = 2
TOL = 1e-5


def _loss_and_grads(kind: str, checkpoint_num_layers: int):
    cfg = common.make_config(kind, checkpoint_num_layers=checkpoint_num_layers, **DROPOUT)
    model = common.build_plain(kind, cfg)
    for micro in common.make_batches(kind, cfg, 1, 2 * common.MBS)[0]:
        loss = common.micro_loss(model, micro)
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
def test_checkpointing_keeps_gradients_with_dropout(kind):
    loss, grads = _loss_and_grads(kind, 0)
    for n in (1, 2):
        loss_ckpt, grads_ckpt = _loss_and_grads(kind, n)
        assert torch.equal(loss, loss_ckpt), f"checkpoint_num_layers={n}: loss {loss_ckpt} vs {loss}"
        for name, g in grads.items():
            assert torch.equal(g, grads_ckpt[name]), f"checkpoint_num_layers={n}: gradient of {name} differs"


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
def test_dropout_is_active_and_fresh_per_call(kind):
    cfg = common.make_config(kind, **DROPOUT)
    model = common.build_plain(kind, cfg)
    micro = common.make_batches(kind, cfg, 1, common.MBS)[0][0]
    first, second = common.micro_loss(model, micro), common.micro_loss(model, micro)
    model.eval()
    plain = common.micro_loss(model, micro)
    assert len({first.item(), second.item(), plain.item()}) == 3


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
def test_masks_follow_iteration_and_micro_batch(kind):
    """Two iterations of two micro-batches, an evaluation before each; then a fresh model (same weights)
    told iteration 1 gives micro-batch 0 of iteration 1 bit for bit. The device generator and Megatron's
    tracker streams are where they were: the model's dropout draws from neither."""
    from megatron import mpu
    from megatron.model.rng import start_iteration
    cfg = common.make_config(kind, **DROPOUT)
    model, fresh = common.build_plain(kind, cfg), common.build_plain(kind, cfg)
    fresh.load_state_dict(model.state_dict())
    micro_batches = common.make_batches(kind, cfg, 1, 2 * common.MBS)[0]
    mpu.model_parallel_seed(11, tp_rank=0)
    device_before, tracker_before = torch.get_rng_state(), mpu.get_rng_tracker().get_states()
    losses = {}
    for iteration in (0, 1):
        start_iteration(model, iteration)
        model.eval()
        common.micro_loss(model, micro_batches[0])
        model.train()
        for m, micro in enumerate(micro_batches):
            losses[iteration, m] = common.micro_loss(model, micro)
    start_iteration(fresh, 1)
    assert torch.equal(common.micro_loss(fresh, micro_batches[0]), losses[1, 0])
    assert not torch.equal(losses[0, 0], losses[1, 0]), "another iteration must draw other masks"
    assert torch.equal(torch.get_rng_state(), device_before)
    assert all(torch.equal(v, tracker_before[k]) for k, v in mpu.get_rng_tracker().get_states().items())


def _jobs(pp: int) -> list:
    jobs = [dict(kind=k, tp=1, pp=pp, dp=1, config_kw=DROPOUT, steps=STEPS) for k in ("gpt2", "t5")]
    if pp == 2:
        jobs += [dict(kind=k, tp=1, pp=2, dp=1, config_kw={**DROPOUT, "checkpoint_num_layers": 1}, steps=STEPS)
                 for k in ("gpt2", "t5")]
    return jobs


@pytest.mark.parametrize("pp", [1, 2])
def test_dropout_same_in_every_layout(pp):
    jobs = _jobs(pp)
    per_rank = run_distributed(common.run_jobs, pp, jobs, timeout=500)
    refs = {}
    for j, job in enumerate(jobs):
        kind = job["kind"]
        if kind not in refs:
            cfg = common.make_config(kind, **DROPOUT)
            refs[kind] = common.reference_run(kind, cfg, common.make_batches(kind, cfg, STEPS, common.MBS * common.GAS))
        results = [r[j] for r in per_rank]
        assert len(results) == pp and len(refs[kind]["losses"]) == STEPS
        for r in results:
            assert len(r["losses"]) == STEPS, f"{kind} pp={pp}: {len(r['losses'])} losses for {STEPS} steps"
            for step, (got, want) in enumerate(zip(r["losses"], refs[kind]["losses"])):
                assert abs(got - want) <= TOL * abs(want), \
                    f"{kind} pp={pp} {job['config_kw']}: step {step} loss {got} vs plain {want}"
            assert abs(r["eval_loss"] - refs[kind]["eval_loss"]) <= TOL * abs(refs[kind]["eval_loss"])
        common.check_grads(results, refs[kind]["grads"], 1, TOL)


@pytest.mark.parametrize("tp", [2, 4])
def test_split_sites_draw_the_single_process_masks(tp):
    """A tp rank's heads (attention probabilities, through the attention core, causal, masked and biased) and
    its columns (T5's inner feed-forward) draw the single process's masks for that slice: the ranks' outputs
    concatenate to the single process's, bit for bit."""
    from megatron.model.attention import attention_core
    from megatron.model.rng import SeededDropout

    def site(part=(0, 0, 1)):
        return SeededDropout(0.3, 7, 3, 0, part=part).train()

    g = torch.Generator().manual_seed(0)
    b, n, s, d = 2, 8, 6, 4
    q, k, v = (torch.randn(b, n, s, d, generator=g) for _ in range(3))
    bool_mask = torch.rand(b, 1, s, s, generator=g) > 0.3
    bool_mask |= torch.eye(s, dtype=torch.bool)  # every query attends somewhere
    bias = torch.randn(b, n, s, s, generator=g)
    heads = n // tp
    for kw in (dict(is_causal=True), dict(mask=bool_mask), dict(mask=bias, scale=1.0)):
        mask = kw.pop("mask", None)
        whole = attention_core(q, k, v, mask, site(), **kw)
        parts = [attention_core(q[:, r * heads:(r + 1) * heads], k[:, r * heads:(r + 1) * heads],
                                v[:, r * heads:(r + 1) * heads],
                                mask if mask is None or mask.size(1) == 1 else mask[:, r * heads:(r + 1) * heads],
                                site((1, r, tp)), **kw) for r in range(tp)]
        assert torch.equal(torch.cat(parts, 1), whole), kw
    x = torch.randn(b, s, 16, generator=g)
    whole = site()(x)
    assert torch.equal(torch.cat([site((-1, r, tp))(c) for r, c in enumerate(x.chunk(tp, -1))], -1), whole)
