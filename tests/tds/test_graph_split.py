"""B/W split through the autograd graph (tds/pipe/graph_split.py): B then W equals one full backward, bitwise
in fp32, for modules that know nothing of it (nn.Linear + GELU + LayerNorm, nn.TransformerEncoderLayer, a
weight used at two depths), with each micro-batch's W one micro-batch late as in ZB-H1; B computes the input
gradient and no weight gradient; a stage input that needs no gradient (the first stage) leaves all to W;
a reentrant checkpoint makes B compute everything, named in `unsplit`; post-accumulate hooks fire in W.

Shapes: b batch, s sequence, h hidden.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tds.pipe import graph_split

H, B, S, MICRO = 16, 3, 5, 4


class TwoDepths(nn.Module):
    """A weight used twice, the second time after another linear: y = W tanh(W x + b) (b, s, h)."""

    def __init__(self):
        super().__init__()
        self.lin, self.norm = nn.Linear(H, H), nn.LayerNorm(H)

    def forward(self, x):
        return self.norm(self.lin(torch.tanh(self.lin(x))))


class Reentrant(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(H, H), nn.Tanh(), nn.Linear(H, H))

    def forward(self, x):
        return checkpoint(self.body, x, use_reentrant=True)


MODELS = {
    "mlp": lambda: nn.Sequential(nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H, bias=False), nn.LayerNorm(H)),
    "encoder": lambda: nn.TransformerEncoderLayer(H, 4, 2 * H, dropout=0.0, batch_first=True),
    "two_depths": TwoDepths,
}


def build(name: str) -> nn.Module:
    torch.manual_seed(0)
    return MODELS[name]() if name in MODELS else Reentrant()


def data():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)) for _ in range(MICRO)]


def full(model, batches, input_grad: bool):
    dx = []
    for x, dy in batches:
        x = x.clone().requires_grad_(input_grad)
        model(x).backward(dy)
        dx.append(x.grad)
    return {n: p.grad.clone() for n, p in model.named_parameters()}, dx


def split(model, batches, input_grad: bool):
    """B of micro-batch i, then W of i-1 (ZB-H1's order on a middle stage); W of the last at the end."""
    params = list(model.parameters())
    pending, dx, after_first_b = [], [], None
    for i, (x, dy) in enumerate(batches):
        x = x.clone().requires_grad_(input_grad)
        pending.append(graph_split.backward_input([model(x)], [dy], params))
        dx.append(x.grad)
        if i == 0:
            after_first_b = [p.grad is not None for p in params]
        if i:
            pending.pop(0).run()
    pending.pop(0).run()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, dx, after_first_b, pending


@pytest.mark.parametrize("input_grad", [True, False])
@pytest.mark.parametrize("name", sorted(MODELS))
def test_b_then_w_equals_full_backward_bitwise(name, input_grad):
    ref_grads, ref_dx = full(build(name), data(), input_grad)
    grads, dx, after_first_b, _ = split(build(name), data(), input_grad)
    assert not any(after_first_b)  # B left every weight gradient to W
    for a, b in zip(dx, ref_dx):
        assert (a is None and b is None) or torch.equal(a, b)
    assert grads.keys() == ref_grads.keys()
    for n in grads:
        assert torch.equal(grads[n], ref_grads[n]), n


def test_reentrant_checkpoint_is_computed_in_b_and_named():
    model = build("reentrant")
    ref_grads, ref_dx = full(build("reentrant"), data(), True)
    x, dy = data()[0]
    done = graph_split.backward_input([model(x.clone().requires_grad_())], [dy], list(model.parameters()))
    assert done.unsplit == list(model.parameters()) and "reentrant activation checkpointing" in done.reason
    assert all(p.grad is not None for p in model.parameters())
    grads, dx, after_first_b, _ = split(build("reentrant"), data(), True)
    assert all(after_first_b)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_unused_parameter_is_named_and_w_fires_accumulate_hooks():
    model = nn.Sequential(nn.Linear(H, H), nn.Tanh())
    unused = nn.Parameter(torch.ones(2))
    seen = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    x, dy = data()[0]
    done = graph_split.backward_input([model(x.clone().requires_grad_())], [dy], list(model.parameters()) + [unused])
    assert done.unsplit == [unused] and not seen
    done.run()
    assert len(seen) == 1 and torch.equal(seen[0], model[0].weight.grad)
