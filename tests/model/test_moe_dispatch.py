"""megatron/model/moe_dispatch.py, the all-to-all dispatcher, on 2 and 4 gloo ranks (one expert-parallel group):

- permuting and un-permuting (identity experts; each token's choices weighted 1 and 0, some dropped) returns every
  rank's input exactly, and its gradient exactly;
- a MoE layer (8 experts, top-2, a shared expert) whose experts are spread over the group, with either dispatcher
  (allgather, alltoall: one run computes both, and they agree within 1e-6), gives each rank the
  output and input gradient of one process running all experts on that rank's tokens, each rank's experts the
  gradients of one process over every rank's tokens, and the router and shared expert, summed over the ranks, theirs
  too (fp32, relative error under 1e-6);
- an expert no token of any rank chose leaves its weights without gradient.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from harness.dist import run_distributed
from megatron.model.moe import MoEConfig, MoELayer
from megatron.model.moe_dispatch import dispatch_combine

E, H = 8, 16
CFG = MoEConfig(num_experts=E, ffn_hidden_size=24, topk=2, shared_ffn_hidden_size=32)


def _identity_rank() -> bool:
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(10 + rank)
    x = torch.randn(20, H, generator=g, requires_grad=True)
    experts = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(20)])
    experts[::5, 1] = -1  # some second choices dropped
    probs = torch.tensor([[1.0, 0.0]]).expand(20, 2)
    out = dispatch_combine(x, probs, experts, E, lambda j, rows: rows, dist.group.WORLD)
    grad = torch.randn(20, H, generator=g)
    out.backward(grad)
    return torch.equal(out, x) and torch.equal(x.grad, grad)


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(3, 7, H, generator=torch.Generator().manual_seed(20 + rank))


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _layer_rank() -> dict:
    errors, outputs = {}, {}
    for dispatcher in ("allgather", "alltoall"):
        found, outputs[dispatcher] = _layer_errors(dispatcher)
        errors.update({f"{dispatcher}: {what}": err for what, err in found.items()})
    errors["allgather against alltoall"] = _rel(outputs["allgather"], outputs["alltoall"])
    return errors


def _layer_errors(dispatcher: str) -> tuple:
    rank, size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    full = MoELayer(CFG, H)  # the same weights on every rank: the reference
    with torch.no_grad():
        full.router.weight[E - 1] = -10.0  # no token picks the last expert (x > 0 below)
    layer = MoELayer(dataclasses.replace(CFG, dispatcher=dispatcher), H, ep_group=dist.group.WORLD)
    local = E // size
    with torch.no_grad():
        for name, p in layer.named_parameters():
            src = dict(full.named_parameters())[name]
            p.copy_(src[rank * local:(rank + 1) * local] if name.startswith("experts.") else src)
    xs = [_tokens(r).abs() for r in range(size)]
    x = xs[rank].clone().requires_grad_()
    out, _ = layer(x)
    out.square().sum().backward()
    router, shared = layer.router.weight.grad.clone(), layer.shared_expert.linear_fc1.grad.clone()
    for replicated in (router, shared):  # every rank's tokens: summed as data-parallel gradients are
        dist.all_reduce(replicated)
    ref_x = torch.cat(xs).requires_grad_()
    ref, _ = full(ref_x)
    ref.square().sum().backward()
    rows = slice(rank * 3, (rank + 1) * 3)
    mine = slice(rank * local, (rank + 1) * local)
    errors = {"output": _rel(out, ref[rows]), "input grad": _rel(x.grad, ref_x.grad[rows]),
              "router grad": _rel(router, full.router.weight.grad),
              "fc1 grad": _rel(layer.experts.linear_fc1.grad, full.experts.linear_fc1.grad[mine]),
              "fc2 grad": _rel(layer.experts.linear_fc2.grad, full.experts.linear_fc2.grad[mine]),
              "shared grad": _rel(shared, full.shared_expert.linear_fc1.grad)}
    if rank == size - 1:  # the last expert: no token of any rank
        errors["unused expert has no gradient"] = float(torch.count_nonzero(layer.experts.linear_fc1.grad[-1]))
    return errors, out.detach()


@pytest.mark.parametrize("ep", [2, 4])
def test_permute_and_unpermute_return_the_input_and_its_gradient_exactly(ep):
    assert run_distributed(_identity_rank, ep) == [True] * ep


@pytest.mark.parametrize("ep", [2, 4])
def test_experts_spread_over_ranks_equal_one_process(ep):
    for rank, errors in enumerate(run_distributed(_layer_rank, ep)):
        for what, err in errors.items():
            assert err < 1e-6, f"ep {ep}, rank {rank}: {what}: {err:.2e}"
