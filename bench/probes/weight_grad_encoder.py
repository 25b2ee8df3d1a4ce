"""ZB-H1's B (input gradient) and W (weight gradients) of plain nn.TransformerEncoderLayers, the two ways the
engine splits a backward, against one full backward.

    python bench/probes/weight_grad_encoder.py [--layers 4] [--hidden 256] [--tokens 256] [--repeats 20]

Model: `layers` x nn.TransformerEncoderLayer(h, 4 heads, 4h, dropout 0, batch_first), fp32, one thread,
input (b = tokens / 64, s = 64, h). Per micro-batch, after the same forward:

    full    y.backward(dy)
    graph   B: graph_split.backward_input(y, dy, params)   autograd.backward(inputs=<x>, retain_graph=True)
            W: its run()                                   one autograd.backward per group of parameters
    routed  forward inside weight_grad.route_linears: F.linear on the layers' weights (nn.Linear and
            nn.MultiheadAttention's projections) defers dW, db to the store, as the engine does on ZB-H1
            stages; B: y.backward(dy) inside store.defer; W: store.run (dW = dY^T X, db = sum dY per linear);
            the LayerNorms' gradients come in B

Protocol: 3 warm-up rounds, then `repeats` rounds; each figure is the median over rounds of one micro-batch's
CPU time of this thread (`time.thread_time`, so that other jobs on a shared machine change it less than the
wall time). All three give the same gradients (checked, relative error < 1e-6).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn
from weight_grad_split import check_gradients  # bench/probes/ is on the path when a script runs

from tds.pipe import graph_split
from tds.pipe.weight_grad import WeightGradStore, route_linears


def timed(fn) -> float:
    t = time.thread_time()
    fn()
    return (time.thread_time() - t) * 1e3


def one_round(model, params, x, dy) -> dict:
    out = {}
    for p in params:
        p.grad = None
    y = model(x)
    out["full"] = timed(lambda: y.backward(dy))
    ref = [p.grad.clone() for p in params]

    for p in params:
        p.grad = None
    y = model(x)
    done = []
    out["graph B"] = timed(lambda: done.append(graph_split.backward_input([y], [dy], params)))
    out["graph W"] = timed(done[0].run)
    got_graph = [p.grad.clone() for p in params]

    for p in params:
        p.grad = None
    store = WeightGradStore()
    with route_linears({id(p): p for p in params}, store):
        y = model(x)

    def b_routed():
        with store.defer(0):
            y.backward(dy)
    out["routed B"] = timed(b_routed)
    out["routed W"] = timed(lambda: store.run(0))
    check_gradients((("graph", got_graph), ("routed", [p.grad for p in params])), ref)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.TransformerEncoderLayer(args.hidden, 4, 4 * args.hidden, dropout=0.0,
                                                       batch_first=True) for _ in range(args.layers)])
    params = list(model.parameters())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(args.tokens // 64, 64, args.hidden, generator=g).requires_grad_()  # (b, s, h)
    dy = torch.randn(args.tokens // 64, 64, args.hidden, generator=g)
    rounds = [one_round(model, params, x, dy) for _ in range(3 + args.repeats)][3:]
    med = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(f"{args.layers} x nn.TransformerEncoderLayer(h={args.hidden}, 4 heads, ff {4 * args.hidden}), "
          f"{args.tokens} tokens, fp32, 1 thread, median of {args.repeats} rounds (CPU ms per micro-batch)")
    print(f"full backward  {med['full']:8.2f}")
    for way in ("graph", "routed"):
        b, w = med[f"{way} B"], med[f"{way} W"]
        print(f"{way:6s}  B {b:8.2f}  W {w:8.2f}  B+W {b + w:8.2f}  = {(b + w) / med['full']:.2f} x full")


if __name__ == "__main__":
    main()
