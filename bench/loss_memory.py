"""The vocab-parallel cross entropy, eager vs fused (--cross-entropy-loss-fusion): bytes per logit saved for
backward and allocated at the forward's and the backward's peak, time, and the gradients compared.

    python bench/loss_memory.py [--rows 512] [--vocab 50304] [--rounds 5]

Protocol: one process, one thread, tp = 1; logits (rows, vocab) as a leaf in fp32 and in bf16 (GPT-2's padded
vocabulary by default), random targets, the masked mean loss (`masked_lm_loss`) of the model's last stage.
"saved" = the distinct storages autograd keeps at the end of the forward (saved_tensors_hooks), the logits
included when the loss keeps them; "forward peak" / "backward peak" = the largest rise of the CPU allocator
above the start of that pass (torch.profiler with profile_memory=True, megatron.training.memory_log's running
sum), the logits themselves not included (they exist before). Each divided by rows x vocab. Time: forward +
backward, eager and fused interleaved per round, the median of --rounds rounds; the ratio is fused / eager.
The gradients and losses must be identical (the fused form runs the eager operations on each row).
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from megatron.model.language_model import masked_lm_loss
from megatron.training.memory_log import _rise

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def run(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, fused: bool, measure: bool) -> dict:
    x = logits.detach().clone().requires_grad_(True)
    storages = {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    start = time.perf_counter()
    if measure:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof, \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = masked_lm_loss(x, labels, mask, fused=fused)
        forward = _rise(prof)
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            loss.backward()
        backward = _rise(prof)
    else:
        loss = masked_lm_loss(x, labels, mask, fused=fused)
        loss.backward()
        forward = backward = 0
    return dict(seconds=time.perf_counter() - start, saved=sum(storages.values()), forward=forward,
                backward=backward, loss=loss.detach(), grad=x.grad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=512, help="tokens (b x s) of one micro-batch")
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(1)
    print(f"rows {a.rows}, vocabulary {a.vocab}, tp 1, one thread; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("| dtype | form | saved B/logit | forward peak B/logit | backward peak B/logit | ms (median) | "
          "fused / eager time | identical |")
    print("|---|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, dtype in DTYPES.items():
        logits = (torch.randn(a.rows, a.vocab, generator=gen) * 4).to(dtype)
        labels, mask = torch.randint(0, a.vocab, (a.rows,), generator=gen), torch.ones(a.rows)
        n = a.rows * a.vocab
        first = {fused: run(logits, labels, mask, fused, measure=True) for fused in (False, True)}
        times = {False: [], True: []}
        for _ in range(a.rounds):
            for fused in (False, True):
                times[fused].append(run(logits, labels, mask, fused, measure=False)["seconds"])
        same = torch.equal(first[True]["grad"], first[False]["grad"]) and \
            torch.equal(first[True]["loss"], first[False]["loss"])
        eager_ms = statistics.median(times[False]) * 1e3
        for fused in (False, True):
            r, ms = first[fused], statistics.median(times[fused]) * 1e3
            print(f"| {name} | {'fused' if fused else 'eager'} | {r['saved'] / n:.2f} | {r['forward'] / n:.2f} | "
                  f"{r['backward'] / n:.2f} | {ms:.1f} | {ms / eager_ms:.3f} | {'yes' if same else 'NO'} |")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
