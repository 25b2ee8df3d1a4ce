"""Where the time of one activation hop goes in the TDS engine, with the short sleeping layers of
`bench/pipeline_bubble.py` (p = 4, m = 8, F = B = W = 20 ms per stage), beside a bare gloo hop.

A hop is on the critical path when the receiving stage already waits in its receive when the sending stage's F
ends (receives are posted ahead, so a stage that does not wait takes the message in while it computes). For
those hops, on one clock (`time.perf_counter` is CLOCK_MONOTONIC, one clock for every process of a host):

    F end -> send instruction      the executor between the two instructions
    packing                        `Boundary.send_activations` up to `P2P.send`
    gloo send call                 `P2P.send`: gloo's send, which on a posted receive writes the message to the
                                   socket at once (on loopback the kernel delivers it inside the call)
    sent -> receive returned       the transport and the waiting stage's wake-up (gloo's event thread reads the
                                   message and wakes the waiting thread)
    unpacking                      the rest of `recv_activations` (reading the flag: the tuple was built when
                                   the receive was posted)
    -> next F                      the executor up to the next F

Each is timed by wrapping the executor's handlers and `P2P.send` / `P2P.wait_recv` (batch 3 of 3; the first
two warm up); printed as median and mean over the critical hops of all stages. The receiver can wake before
the sender's send call returns (the last two overlap, "sent -> receive returned" is then negative), so the
segments' medians need not add up to the hop's. The bare hop is
`bare_hop_ms` (harness/sleeping_pipeline.py), measured in the same processes before the engines are built: what
gloo and the machine cost with no engine. At p = 4, m = 8 the schedule simulator keeps 1F1B within 5% of its
formula up to 0.79 ms per hop and interleaved within 10% up to 0.78 ms (`pipeline_bubble.py`'s "as hop").

    .venv/bin/python bench/probes/pipeline_hops.py [--ms 20] [--schedules 1f1b interleaved]
"""
from __future__ import annotations

import argparse
import statistics
import time

from harness import sleeping_pipeline as sleeping
from harness.spawn import run_on_ranks

SEGMENTS = ("F end -> send instruction", "packing", "gloo send call", "sent -> receive returned", "unpacking",
            "-> next F", "hop")
TIMED = ("_exec_forward", "_exec_send_act", "_exec_recv_act")


def _instrument(log: list) -> None:
    """Append (event, micro_batch, chunk, start, end) to `log` for the timed handlers, sends and receive waits."""
    from tds.pipe import p2p
    from tds.pipe.executor import StageExecutor
    clock = time.perf_counter
    send, wait = p2p.P2P.send, p2p.P2P.wait_recv

    def logged(event: str, ins, start: float) -> None:
        log.append((event, getattr(ins, "micro_batch", -1), getattr(ins, "chunk", -1), start, clock()))

    def handler(name: str):
        call = getattr(StageExecutor, name)

        def timed(self, ins, state):
            start = clock()
            call(self, ins, state)
            logged(name, ins, start)
        return timed

    def timed_send(self, t, peer, what, header=False):
        start = clock()
        work = send(self, t, peer, what, header)
        logged(f"sent {what.op.name}", what, start)
        return work

    def timed_wait(self, posted, what):
        start = clock()
        received = wait(self, posted, what)
        logged(f"received {what.op.name}", what, start)
        return received

    for name in TIMED:
        setattr(StageExecutor, name, handler(name))
    p2p.P2P.send, p2p.P2P.wait_recv = timed_send, timed_wait


def ranks(schedules: list, ms: float) -> dict | None:
    """On every rank: the bare hop, then three batches per schedule with the hops' events logged; rank 0 gets
    every stage's log of the last batch per schedule."""
    import torch.distributed as dist
    hop = sleeping.bare_hop_ms(ms)
    log: list = []
    _instrument(log)
    out = {"bare_hop_ms": hop}
    for schedule, v in schedules:
        engine = sleeping.build(schedule, v, 8, ms / 1e3 / sleeping.LAYERS_PER_STAGE, "")
        batches = sleeping.data()
        for _ in range(3):
            log.clear()
            engine.train_batch(batches)
        everyone = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, list(log))
        out[(schedule, v)] = everyone
    return out if dist.get_rank() == 0 else None


def critical_hops(logs: list, v: int) -> list[tuple]:
    """Per activation hop whose receiver waited before the sender's F ended: the SEGMENTS' seconds."""
    events = {(stage, name, mb, chunk): (start, end) for stage, log in enumerate(logs)
              for name, mb, chunk, start, end in log}
    last, hops = len(logs) - 1, []
    for (stage, name, mb, chunk), (_, f_end) in events.items():
        if name != "_exec_forward" or (stage, chunk) == (last, v - 1):
            continue
        to = (stage + 1, chunk) if stage < last else (0, chunk + 1)  # interleaved: the last stage feeds chunk + 1
        try:
            send = events[(stage, "_exec_send_act", mb, chunk)][0]
            call, sent = events[(stage, "sent SEND_ACT", mb, chunk)]
            received = events[(to[0], "received RECV_ACT", mb, to[1])][1]
            waiting, unpacked = events[(to[0], "_exec_recv_act", mb, to[1])]
            next_f = events[(to[0], "_exec_forward", mb, to[1])][0]
        except KeyError:
            continue
        if waiting < f_end:
            hops.append((send - f_end, call - send, sent - call, received - sent, unpacked - received,
                         next_f - unpacked, next_f - f_end))
    return hops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ms", type=float, default=20.0, help="F, B and W time of one stage per micro-batch (ms)")
    p.add_argument("--schedules", nargs="+", default=["1f1b", "interleaved"], choices=["1f1b", "interleaved"])
    args = p.parse_args()
    schedules = [(s, 2 if s == "interleaved" else 1) for s in args.schedules]
    result = run_on_ranks(ranks, sleeping.P, schedules, args.ms)
    print(f"p = {sleeping.P}, m = 8, F = B = W = {args.ms:g} ms per stage; bare gloo hop (idle receiver, no engine): "
          f"median {result['bare_hop_ms']:.2f} ms")
    for schedule, v in schedules:
        hops = critical_hops(result[(schedule, v)], v)
        print(f"{schedule}{f' v={v}' if v > 1 else ''}: {len(hops)} hops with the receiver waiting")
        for i, name in enumerate(SEGMENTS):
            values = [h[i] * 1e3 for h in hops]
            print(f"  {name:28s} median {statistics.median(values):6.3f} ms  mean {statistics.mean(values):6.3f} ms")


if __name__ == "__main__":
    main()
