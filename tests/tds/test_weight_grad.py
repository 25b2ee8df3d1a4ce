"""The zero-bubble W mechanism (tds/pipe/weight_grad.py): B then W equals one full backward.

Bitwise (torch.equal) in fp32 for an MLP stack with LayerNorms, over several micro-batches in ZB-H1's order
and in all-B-then-all-W order; relative error < 1e-6 where a weight also gets a gradient outside the store
(tied embedding: its two contributions are added in another order). Shapes: b batch, s sequence, h hidden.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tds.pipe.weight_grad import Linear, WeightGradStore, attach, linear, route_linears

H, B, S, MICRO = 16, 3, 5, 4


def mlp(layers: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [nn.Linear(H, 2 * H), nn.GELU(), nn.Linear(2 * H, H, bias=False), nn.LayerNorm(H)]
    return nn.Sequential(*mods)


def deferrable(ref: nn.Module) -> nn.Module:
    """A copy of `ref` whose nn.Linear layers are weight_grad.Linear (same parameters' values)."""
    model = copy.deepcopy(ref)
    for name, mod in list(model.named_children()):
        if type(mod) is nn.Linear:
            new = Linear(mod.in_features, mod.out_features, bias=mod.bias is not None)
            new.load_state_dict(mod.state_dict())
            setattr(model, name, new)
    return model


def batches():
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(B, S, H, generator=g), torch.randn(B, S, H, generator=g)) for _ in range(MICRO)]


def grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


def reference(model, data):
    xs = []
    for x, dy in data:
        x = x.clone().requires_grad_()
        model(x).backward(dy)
        xs.append(x.grad)
    return grads(model), xs


def zb_order(n):
    """B0 B1 W0 B2 W1 ... : each W one micro-batch late, as on stage 1 of ZB-H1."""
    out = []
    for i in range(n):
        out += [("B", i)] + ([("W", i - 1)] if i else [])
    return out + [("W", n - 1)]


@pytest.mark.parametrize("order", ["zb", "all_b_then_w"])
def test_b_then_w_equals_full_backward_bitwise(order):
    ref = mlp()
    model = deferrable(ref)
    store = WeightGradStore()
    assert attach(model, store) == 6
    data = batches()
    ref_grads, ref_dx = reference(ref, data)
    steps = zb_order(MICRO) if order == "zb" else [("B", i) for i in range(MICRO)] + [("W", i) for i in range(MICRO)]
    dx = {}
    for phase, i in steps:
        if phase == "W":
            store.run(i)
            continue
        x = data[i][0].clone().requires_grad_()
        with store.defer(i):
            model(x).backward(data[i][1])
        dx[i] = x.grad
        if i == 0:  # after the first B: LayerNorm gradients are there, deferred linear ones not yet
            assert model[3].weight.grad is not None and model[0].weight.grad is None and model[0].bias.grad is None
    assert store.pending() == []
    for i in range(MICRO):
        assert torch.equal(dx[i], ref_dx[i])
    got = grads(model)
    assert got.keys() == ref_grads.keys()
    for name in got:
        assert torch.equal(got[name], ref_grads[name]), name


def encoder(layers: int = 2) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.TransformerEncoderLayer(H, 2, 2 * H, dropout=0.0, batch_first=True)
                           for _ in range(layers)])


@pytest.mark.parametrize("make", [mlp, encoder])
def test_routed_f_linear_defers_any_linear_bitwise(make):
    """route_linears: plain nn.Linear and nn.MultiheadAttention's projections (F.linear calls on the given
    weights) defer dW, db to the store, in ZB-H1's order; results equal full backwards bitwise."""
    ref, model = make(), make()
    data = batches()
    ref_grads, ref_dx = reference(ref, data)
    store = WeightGradStore()
    weights = {id(p): p for p in model.parameters()}
    linears = {id(p) for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    linears |= {id(m.in_proj_weight) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    graphs, dx = {}, {}
    for phase, i in zb_order(MICRO):
        if phase == "W":
            store.run(i)
            continue
        x = data[i][0].clone().requires_grad_()
        with route_linears(weights, store) as routed:
            y = model(x)
        assert {id(w) for w in routed} == {id(p) for p in model.parameters() if p.dim() == 2}
        with store.defer(i):
            y.backward(data[i][1])
        dx[i] = x.grad
        if i == 0:  # linear weights and biases wait for W; norms have theirs
            assert all(p.grad is None for p in model.parameters() if id(p) in linears)
            assert all(p.grad is not None for n, p in model.named_parameters() if "norm" in n or n.endswith("3.weight"))
    assert torch.nn.functional.linear is torch._C._nn.linear  # restored
    assert all(torch.equal(dx[i], ref_dx[i]) for i in range(MICRO))
    for name, g in grads(model).items():
        assert torch.equal(g, ref_grads[name]), name


def test_route_linears_passes_other_calls_through_and_restores_on_error():
    model, other = mlp(1), nn.Linear(H, H)
    store = WeightGradStore()
    with route_linears({id(model[0].weight): model[0].weight}, store) as routed:
        assert other(torch.randn(2, H, requires_grad=True)).grad_fn.name() == "AddmmBackward0"
        assert model[2](torch.randn(2, 2 * H)).grad_fn.name() == "MmBackward0"  # not in the weights given
        with torch.no_grad():
            model[0](torch.randn(2, H))
        assert routed == []
        assert model[0](torch.randn(2, H)).grad_fn.name() == "_LinearBackward"
        assert routed == [model[0].weight]
    with pytest.raises(ValueError):
        with route_linears({}, store):
            raise ValueError
    assert torch.nn.functional.linear is torch._C._nn.linear


def test_not_deferring_is_plain_linear_and_detach_restores_f_linear():
    ref = mlp(1)
    model = deferrable(ref)
    attach(model, WeightGradStore())
    data = batches()
    ref_grads, ref_dx = reference(ref, data)
    _, dx = reference(model, data)  # store attached, never deferring: gradients computed in backward
    for name, g in grads(model).items():
        assert torch.equal(g, ref_grads[name])
    assert all(torch.equal(a, b) for a, b in zip(dx, ref_dx))
    assert attach(model, None) == 2 and model[0].weight_grad_store is None
    x = torch.randn(2, H, requires_grad=True)
    assert model[0](x).grad_fn.name() == "AddmmBackward0"  # plain F.linear again


@pytest.mark.parametrize("reentrant", [False, True])
def test_w_goes_through_autograd_accumulation_hooks_and_activation_checkpointing(reentrant):
    """W accumulates through each parameter's AccumulateGrad, so post-accumulate hooks (DeepSpeed's gradient
    hooks) fire at W with the gradient; in B they fire with .grad None (torch calls them for the None a
    Function returns). Layers recomputed by activation checkpointing defer like the others."""
    ref = mlp(2)
    model = deferrable(ref)
    store = WeightGradStore()
    attach(model, store)
    seen = []
    hook = lambda p: seen.append(None if p.grad is None else p.grad.clone())  # noqa: E731
    model[0].weight.register_post_accumulate_grad_hook(hook)
    data = batches()[:2]
    ref_grads, _ = reference(ref, data)
    for i, (x, dy) in enumerate(data):
        with store.defer(i):
            checkpoint(model, x.clone().requires_grad_(), use_reentrant=reentrant).backward(dy)
        assert len(seen) == 2 * i + 1 and (seen[-1] is None if i == 0 else torch.equal(seen[-1], seen[-2]))
        store.run(i)
        assert len(seen) == 2 * i + 2 and torch.equal(seen[-1], model[0].weight.grad)
    for name, g in grads(model).items():
        assert torch.equal(g, ref_grads[name]), name


class TiedLM(nn.Module):
    """Embedding (V, h) tied with the output projection: the weight gets a gradient in B (lookup) and in W."""

    def __init__(self, store=None):
        super().__init__()
        torch.manual_seed(2)
        self.emb, self.norm, self.store = nn.Embedding(11, H), nn.LayerNorm(H), store

    def forward(self, ids):  # (b, s) -> (b, s, V)
        return linear(self.norm(self.emb(ids)), self.emb.weight, None, self.store)


def test_tied_weight_rel_err():
    ids = torch.randint(0, 11, (MICRO, B, S), generator=torch.Generator().manual_seed(3))
    ref, store = TiedLM(), WeightGradStore()
    model = TiedLM(store)
    for i in range(MICRO):
        ref(ids[i]).logsumexp(-1).sum().backward()
        with store.defer(i):
            model(ids[i]).logsumexp(-1).sum().backward()
        if i:
            store.run(i - 1)
    store.run(MICRO - 1)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        rel = ((p.grad - q.grad).norm() / q.grad.norm()).item()
        assert rel < 1e-6, (name, rel)


def test_store_errors_and_clear():
    store = WeightGradStore()
    with pytest.raises(RuntimeError, match=r"defer\(1\) inside defer\(0\)"):
        with store.defer(0):
            with store.defer(1):
                pass
    assert not store.deferring
    w = nn.Parameter(torch.ones(2, 2))
    with store.defer((0, 1)):  # (micro-batch, chunk) keys
        linear(torch.ones(1, 2, requires_grad=True), w, None, store).sum().backward()
    assert store.pending() == [(0, 1)] and w.grad is None
    store.clear()
    store.run((0, 1))
    assert store.pending() == [] and w.grad is None


# --- tensor parallelism: the phase-2 change to megatron/mpu/layers.py, shown on subclasses ------------------
def _tp_layers():
    """Column/RowParallelLinear whose F.linear call is weight_grad.linear: the few lines layers.py will take."""
    from megatron import mpu

    class Column(mpu.ColumnParallelLinear):
        weight_grad_store = None

        def forward(self, x):  # (b, s, h) -> (b, s, 4h/t)
            out = linear(self._copy_to(x), self.weight, self.bias, self.weight_grad_store)
            return out, None

    class Row(mpu.RowParallelLinear):
        weight_grad_store = None

        def forward(self, x):  # (b, s, 4h/t) -> (b, s, h)
            return self._reduce_from(linear(x, self.weight, None, self.weight_grad_store)) + self.bias, None

    return mpu, Column, Row


def _tp_mlp(mpu, column, row):
    torch.manual_seed(5)
    return column(H, 4 * H, gather_output=False), row(4 * H, H, input_is_parallel=True)


def _tp_run(layers, data, store=None):
    col, row = layers
    for i, (x, dy) in enumerate(data):
        x = x.clone().requires_grad_()
        hidden = torch.nn.functional.gelu(col(x)[0])
        if store is None:
            row(hidden)[0].backward(dy)
        else:
            with store.defer(i):
                row(hidden)[0].backward(dy)
        yield x.grad


def _tp_check():
    import torch.distributed as dist
    mpu, Column, Row = _tp_layers()
    mpu.initialize_model_parallel(2)
    data = batches()
    ref = _tp_mlp(mpu, mpu.ColumnParallelLinear, mpu.RowParallelLinear)
    ref_dx = list(_tp_run(ref, data))
    model, store = _tp_mlp(mpu, Column, Row), WeightGradStore()
    assert sum(attach(layer, store) for layer in model) == 2
    dx = list(_tp_run(model, data, store))
    calls = []
    originals = {name: getattr(dist, name) for name in ("all_reduce", "all_gather", "broadcast")}
    for name, fn in originals.items():
        setattr(dist, name, lambda *a, _n=name, _f=fn, **k: (calls.append(_n), _f(*a, **k))[1])
    try:
        for i in range(MICRO):
            store.run(i)
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)
    same = all(torch.equal(a, b) for a, b in zip(dx, ref_dx))
    for a, b in zip(model, ref):
        same &= torch.equal(a.weight.grad, b.weight.grad) and torch.equal(a.bias.grad, b.bias.grad)
    return same, calls


@pytest.mark.slow
def test_tensor_parallel_linears_defer_locally():
    """tp = 2: the input gradients (with f's all-reduce) come in B, W needs no collective, and B+W equals
    the unchanged layers' full backward bitwise on every rank."""
    from harness.dist import run_distributed
    for same, calls in run_distributed(_tp_check, 2, timeout=120):
        assert same and calls == []
