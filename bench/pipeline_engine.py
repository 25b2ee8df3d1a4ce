"""Throughput of the TDS PipelineEngine against DeepSpeed's own PipelineEngine, in one run.

Protocol: PP=2 (2 processes, 1 intra-op thread each, gloo on CPU), the same token model, config, data and
initial weights for both engines, built side by side; `--warmup` steps each, then `--steps` timed steps
each, alternating TDS and DeepSpeed step by step (each step between barriers) so that load changes on a
shared machine hit both. Throughput is tokens/s = global_batch * seq_len / step time, from the median
step time and from the mean. The inter-stage tensor is one float hidden state
(b, s, h), the case DeepSpeed handles, so both engines run the same computation; TDS also prints its
shape-header traffic (one header of 8*(2+10n) bytes per activation hop) next to the payload traffic.

    .venv/bin/python bench/pipeline_engine.py [--steps 10 --warmup 3 --micro-batches 8 ...]

Model: embedding (V, h) -> L blocks x + W2 gelu(W1 x) (W1: h->2h) -> head (h, V); cross-entropy loss.
Model FLOPs per token (no recompute, convention 6N): 6 * (V*h*2 + L*4h^2) roughly; only ratios are
reported, no MFU (a shared CPU has no meaningful peak).
"""
from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Embed(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, hidden)

    def forward(self, tokens):  # (b, s) -> (b, s, h)
        return self.emb(tokens)


class Block(nn.Module):
    def __init__(self, hidden: int):
        super().__init__()
        self.w1, self.w2 = nn.Linear(hidden, 2 * hidden), nn.Linear(2 * hidden, hidden)

    def forward(self, x):  # (b, s, h) -> (b, s, h)
        return x + self.w2(torch.nn.functional.gelu(self.w1(x)))


class Head(nn.Module):
    def __init__(self, hidden: int, vocab: int):
        super().__init__()
        self.out = nn.Linear(hidden, vocab)

    def forward(self, x):  # (b, s, h) -> (b, s, V)
        return self.out(x)


def cross_entropy(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


def specs(args):
    from deepspeed.pipe import LayerSpec
    return ([LayerSpec(Embed, args.vocab, args.hidden)] + [LayerSpec(Block, args.hidden) for _ in range(args.layers)]
            + [LayerSpec(Head, args.hidden, args.vocab)])


def config(args) -> dict:
    return {"train_micro_batch_size_per_gpu": args.mbs, "gradient_accumulation_steps": args.micro_batches,
            "train_batch_size": args.mbs * args.micro_batches, "steps_per_print": 10 ** 9,
            "gradient_clipping": 0.0, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}


def data(args):
    g = torch.Generator().manual_seed(0)
    items = [(torch.randint(0, args.vocab, (args.mbs, args.seq), generator=g),
              torch.randint(0, args.vocab, (args.mbs, args.seq), generator=g)) for _ in range(args.micro_batches)]
    while True:
        yield from items


def build_engine(name: str, args):
    import deepspeed

    import tds
    torch.manual_seed(1234)  # same initial weights for both engines
    if name == "tds":
        model = tds.pipe.PipelineModule(specs(args), num_stages=2, loss_fn=cross_entropy, partition_method="uniform",
                                        input_grad=[True], input_type=["float"])
        initialize = tds.initialize
    else:
        model = deepspeed.pipe.PipelineModule(specs(args), num_stages=2, loss_fn=cross_entropy,
                                              partition_method="uniform")
        initialize = deepspeed.initialize
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, _, _, _ = initialize(model=model, optimizer=opt, config=config(args))
    return engine


def timed_step(engine, it) -> tuple[float, float]:
    """(seconds, loss) of one train_batch, between barriers so both stages are inside the window."""
    import torch.distributed as dist
    dist.barrier()
    start = time.perf_counter()
    loss = engine.train_batch(it)
    dist.barrier()
    return time.perf_counter() - start, loss.item()


def run(args) -> dict:
    """Both engines built side by side; measured steps alternate between them so load drift hits both."""
    engines = {name: build_engine(name, args) for name in ("tds", "deepspeed")}
    iters = {name: data(args) for name in engines}
    for _ in range(args.warmup):
        for name, engine in engines.items():
            engine.train_batch(iters[name])
    engines["tds"].p2p.stats.reset()
    seconds = {name: [] for name in engines}
    losses = {}
    for _ in range(args.steps):
        for name, engine in engines.items():
            t, losses[name] = timed_step(engine, iters[name])
            seconds[name].append(t)
    tokens = args.mbs * args.micro_batches * args.seq
    out = {name: {"tokens_per_s": tokens / statistics.median(ts), "mean_tokens_per_s": tokens * len(ts) / sum(ts),
                  "loss": losses[name]} for name, ts in seconds.items()}
    s = engines["tds"].p2p.stats
    out["tds"].update(header_bytes_per_step=s.header_bytes / args.steps, header_msgs_per_step=s.header_msgs / args.steps,
                      payload_bytes_per_step=s.payload_bytes / args.steps)
    return out


def worker(rank: int, port: int, args, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
    from tds import device
    device.init_distributed()
    results = run(args)
    if rank == 0:
        queue.put(results)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=20, help="measured steps per engine (alternating)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--micro-batches", type=int, default=8)
    p.add_argument("--mbs", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=1024)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args, queue)) for r in range(2)]
    for proc in procs:
        proc.start()
    results = queue.get()
    for proc in procs:
        proc.join()
    print(f"config: {vars(args)}")
    for name, r in results.items():
        print(f"  {name:9s} tokens/s median-step {r['tokens_per_s']:9.1f}  mean {r['mean_tokens_per_s']:9.1f}  "
              f"final loss {r['loss']:.4f}")
    print(f"ratio TDS / DeepSpeed (median step time): {results['tds']['tokens_per_s'] / results['deepspeed']['tokens_per_s']:.3f}")
    print(f"ratio TDS / DeepSpeed (mean step time):   "
          f"{results['tds']['mean_tokens_per_s'] / results['deepspeed']['mean_tokens_per_s']:.3f}")
    t = results["tds"]
    print(f"TDS layout-change headers per step (after warm-up): {t['header_msgs_per_step']:.0f} messages, {t['header_bytes_per_step']:.0f} "
          f"bytes vs payload {t['payload_bytes_per_step']:.0f} bytes "
          f"({100 * t['header_bytes_per_step'] / t['payload_bytes_per_step']:.3f}%)")


if __name__ == "__main__":
    main()
