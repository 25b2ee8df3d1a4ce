"""What a process pays for its first steps after it slept: the cost that a pipeline stage's instructions meet on a
machine whose layers sleep (`bench/pipeline_bubble.py`), against the same steps on a busy process.

Protocol: 2 gloo processes, 1 thread each. For naps of 0, 1 and 10 ms, 100 rounds of: sleep the nap, then time
six successive small torch ops (x + 1 on 16 floats), one at a time. Then 60 rounds of a stage's transport steps
on rank 0, right after the previous round's receive returned (no nap: a process woken from its wait, as a stage
after a receive) and after a 10 ms nap: the group's `send` of a (2, 8) float message to rank 1 and the post of a
receive from it (gloo announces each posted receive to its peer: one socket write each), rank 1 answering.
Printed: the median of each step in us, and the first op's cost after 10 ms over a busy process's.

On a busy process the first op costs what the next ones do; after a nap its caches (and on a virtual machine
the vCPU) are cold, and a stage of `pipeline_bubble.py --ms 20` runs each send and receive instruction right
after a sleeping layer. The engine's instruction costs measured there (`pipeline_hops.py`) are this machine's
cold costs, not its CPU cost per call (`boundary_hop_cost.py`, hot).

    .venv/bin/python bench/probes/wake_cost.py
"""
from __future__ import annotations

import statistics
import time

import torch

from harness.spawn import run_on_ranks

NAPS_MS = (0.0, 1.0, 10.0)


def successive_ops(nap_ms: float, rounds: int = 100, ops: int = 6) -> list[float]:
    """Median time (us) of each of `ops` successive small torch ops after sleeping `nap_ms`."""
    x = torch.zeros(16)
    rows = []
    for _ in range(rounds):
        if nap_ms:
            time.sleep(nap_ms / 1e3)
        stamps = [time.perf_counter()]
        for _ in range(ops):
            x + 1
            stamps.append(time.perf_counter())
        rows.append([b - a for a, b in zip(stamps, stamps[1:])])
    return [statistics.median(col) * 1e6 for col in zip(*rows)]


def transport_steps(nap_ms: float, rounds: int = 60) -> tuple[float, float] | None:
    """Rank 0's median (send call, receive post) in us after sleeping `nap_ms`; rank 1 answers each round."""
    import torch.distributed as dist
    group, rank = dist.group.WORLD, dist.get_rank()
    out, back = torch.zeros(2, 8), torch.zeros(2, 8)
    sends, posts = [], []
    for _ in range(rounds):
        if rank == 1:
            group.recv([out], 0, 0).wait()
            group.send([back], 0, 1).wait()
            continue
        if nap_ms:
            time.sleep(nap_ms / 1e3)
        t0 = time.perf_counter()
        sent = group.send([out], 1, 0)
        t1 = time.perf_counter()
        posted = group.recv([back], 1, 1)
        t2 = time.perf_counter()
        posted.wait()
        sent.wait()
        sends.append(t1 - t0)
        posts.append(t2 - t1)
    return (statistics.median(sends) * 1e6, statistics.median(posts) * 1e6) if rank == 0 else None


def measure() -> dict | None:
    import torch.distributed as dist
    ops = {nap: successive_ops(nap) for nap in NAPS_MS}  # both ranks, so that the machine is as busy as in a run
    steps = {nap: transport_steps(nap) for nap in (0.0, 10.0)}
    return {"ops": ops, "steps": steps} if dist.get_rank() == 0 else None


def main() -> None:
    result = run_on_ranks(measure, 2)
    print("successive small torch ops after a nap, median us each (2 processes, 1 thread each):")
    for nap, costs in result["ops"].items():
        print(f"  nap {nap:4.0f} ms: " + " ".join(f"{c:7.1f}" for c in costs))
    hot, cold = result["ops"][0.0][0], result["ops"][10.0][0]
    print(f"  first op after 10 ms / on a busy process: {cold / hot:.0f}x ({cold:.0f} / {hot:.1f} us)")
    print("gloo transport steps on rank 0, median us:")
    for nap, (send, post) in result["steps"].items():
        when = f"after a {nap:.0f} ms nap" if nap else "right after its last receive's wait (no nap)"
        print(f"  {when:45s} send call {send:6.1f}  receive post {post:6.1f}")


if __name__ == "__main__":
    main()
