"""The engine's own CPU cost of one pipeline hop, without the transport: `Boundary.send_activations`,
`recv_activations`, `send_grads` and `recv_grads` over a stand-in for `P2P` that only copies the message.

    python bench/probes/boundary_hop_cost.py [--hops 3000] [--rounds 5]

Protocol: one process, one thread; a declared 1-tuple (float (2, 8), grad) sent and received `hops` times in
the steady state (the layout holds: one message per activation hop), then its gradient back; each figure is the
median over `rounds` rounds of the CPU time of this thread per call (`time.thread_time`, so that other jobs on a
shared machine change it less than the wall time), in microseconds. What the transport itself costs (gloo's
isend / irecv, waits) is `bench/pipeline_overhead.py`'s.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections import deque

import torch

from tds.pipe import meta
from tds.pipe.boundary import Boundary
from tds.pipe.p2p import P2PStats


class LoopbackP2P:
    """P2P's interface: a send keeps a copy of the message, a receive copies the oldest one into its buffer."""
    stage_id, batches_done = 0, 0

    def __init__(self):
        self.queue, self.stats = deque(), P2PStats()

    def send(self, t, peer, what, header=False):
        self.queue.append(t.clone())

    def sent(self, work, generation):
        return True  # copied when sent

    def post_recv(self, t, peer, header=False):
        return t

    def wait_recv(self, t, what):
        msg = self.queue.popleft()
        t[:msg.numel()].copy_(msg)
        return t

    def recv(self, t, peer, what, header=False):
        return self.wait_recv(t, what)


def per_call(fn, n: int) -> float:
    start = time.thread_time()
    for _ in range(n):
        fn()
    return (time.thread_time() - start) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hops", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    p2p = LoopbackP2P()
    decl = [meta.TensorDecl(True, "float", False)]
    sender, receiver = (Boundary(p2p, decl, None, 1, 0, torch.device("cpu")) for _ in range(2))
    x = torch.randn(2, 8, requires_grad=True)
    out = x * 2                                                     # what a stage sends: (2, 8)
    sender.send_activations(out, 1, "warm-up")                      # the first hop carries the header
    arrived = receiver.recv_activations(0, "warm-up", True)
    arrived.sum().backward()                                        # the gradient reaches the carrier
    n = args.hops
    rows = {"send_activations": [], "recv_activations": [], "send_grads": [], "recv_grads": []}
    for _ in range(args.rounds):
        rows["send_activations"].append(per_call(lambda: sender.send_activations(out, 1, "hop"), n))
        rows["recv_activations"].append(per_call(lambda: receiver.recv_activations(0, "hop", True), n))
        rows["send_grads"].append(per_call(lambda: receiver.send_grads(arrived, 0, "hop"), n))
        rows["recv_grads"].append(per_call(lambda: sender.recv_grads(out, 1, "hop"), n))
    print(f"one hop of a declared float (2, 8) with grad, steady layout, {n} calls x {args.rounds} rounds, "
          f"1 thread (median CPU us per call)")
    for name, ts in rows.items():
        print(f"  {name:17s} {statistics.median(ts):7.1f} us")


if __name__ == "__main__":
    main()
