"""Cost of splitting a backward into B (input gradient) and W (weight gradient), two ways, on a CPU MLP.

    python bench/probes/weight_grad_split.py [--layers 8] [--hidden 256] [--tokens 512] [--repeats 20]

Model: `layers` blocks of Linear(h, 4h) -> GELU -> Linear(4h, h) -> LayerNorm(h), fp32, one thread.
Per micro-batch, after the same forward:

    full    y.backward(dy)                                                one pass (plain F.linear; and
                                                                           through weight_grad.linear)
    store   B: y.backward(dy) inside WeightGradStore.defer(i)             (tds/pipe/weight_grad.py)
            W: store.run(i)                                                dW = dY^T X, db = sum dY per linear
    prune   B: autograd.backward(y, dy, inputs=[x], retain_graph=True)    plain F.linear: autograd skips
                                                                           every dW and db
            W: autograd.backward(y, dy, inputs=params)                     must redo every layer's dX to reach
                                                                           the earlier layers' weights

Protocol: 3 warm-up rounds, then `repeats` rounds; each figure is the median over rounds of one
micro-batch's time (ms). "held" = bytes kept from the end of B until W: the store's X and dY per linear
against, for prune, every tensor the retained graph saved (parameters excluded). All three give the same
gradients (checked, relative error < 1e-6).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

from tds.pipe.weight_grad import Linear, WeightGradStore, attach


def build(layers: int, h: int) -> nn.Sequential:
    torch.manual_seed(0)
    mods = []
    for _ in range(layers):
        mods += [Linear(h, 4 * h), nn.GELU(), Linear(4 * h, h), nn.LayerNorm(h)]
    return nn.Sequential(*mods)


def saved_bytes(model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Output and the bytes of the distinct non-parameter storages the forward saved for backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = model(x)
    return y, sum(seen.values())


def store_bytes(store: WeightGradStore) -> int:
    total = {}
    for _, fn in store._queues.get(0, []):
        for cell in fn.__closure__:
            if torch.is_tensor(cell.cell_contents):
                s = cell.cell_contents.untyped_storage()
                total[s.data_ptr()] = s.nbytes()
    return sum(total.values())


def timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def one_round(model, store, params, x, dy) -> dict:
    out = {}
    for p in params:
        p.grad = None
    y = model(x)
    out["full store"] = timed(lambda: y.backward(dy))  # store attached, not deferring
    ref = [p.grad.clone() for p in params]

    for p in params:
        p.grad = None
    y = model(x)

    def b_store():
        with store.defer(0):
            y.backward(dy)
    out["store B"] = timed(b_store)
    out["store held"] = store_bytes(store)
    out["store W"] = timed(lambda: store.run(0))
    got_store = [p.grad.clone() for p in params]

    for p in params:
        p.grad = None
    attach(model, None)  # plain F.linear: autograd's own nodes skip the outputs `inputs=` does not ask for
    try:
        y = model(x)
        out["full"] = timed(lambda: y.backward(dy))
        for p in params:
            p.grad = None
        xi = x.clone().requires_grad_()
        y, out["prune held"] = saved_bytes(model, xi)
        out["prune B"] = timed(lambda: torch.autograd.backward(y, dy, inputs=[xi], retain_graph=True))
        assert all(p.grad is None for p in params)
        out["prune W"] = timed(lambda: torch.autograd.backward(y, dy, inputs=params))
    finally:
        attach(model, store)
    check_gradients((("store", got_store), ("prune", [p.grad for p in params])), ref)
    return out


def check_gradients(results, ref) -> None:
    """Each (name, gradients) of `results` equals the full backward's `ref` (relative error under 1e-6)."""
    for name, got in results:
        assert len(got) == len(ref), (name, len(got), len(ref))
        for g, r in zip(got, ref):
            rel = ((g - r).norm() / r.norm()).item()
            assert rel < 1e-6, (name, rel)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, store = build(args.layers, args.hidden), WeightGradStore()
    attach(model, store)
    params = list(model.parameters())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens, args.hidden, generator=g).requires_grad_()
    dy = torch.randn(args.tokens, args.hidden, generator=g)
    rounds = [one_round(model, store, params, x, dy) for _ in range(3 + args.repeats)][3:]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"MLP {args.layers} x (Linear {args.hidden}->{4 * args.hidden}, GELU, Linear, LayerNorm), "
          f"{args.tokens} tokens, fp32, 1 thread, median of {args.repeats} rounds (ms per micro-batch)")
    print(f"full backward         {med['full']:8.2f}   ({med['full store']:.2f} through weight_grad.linear, "
          f"not deferring)")
    for way in ("store", "prune"):
        b, w = med[f"{way} B"], med[f"{way} W"]
        print(f"{way:5s}  B {b:8.2f}  W {w:8.2f}  B+W {b + w:8.2f}  = {(b + w) / med['full']:.2f} x full;"
              f"  held from B to W: {med[f'{way} held'] / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
