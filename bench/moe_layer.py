"""CPU tokens/s of a mixture-of-experts layer against a dense SwiGLU MLP of the same active FLOPs, in one run.

    python bench/moe_layer.py [--hidden 512 --expert-ffn 1024 --experts 8 --topk 2 --seq 512 --micro-batch 4]
                              [--capacity-factor None --warmup 2 --steps 3 --rounds 5 --threads 1]

The two sides (one process, fp32, tp = ep = 1):
    MoE      megatron.model.moe.MoELayer: the router (h -> E, fp32), top-k softmax routing (Mixtral's), dropless
             unless --capacity-factor, E SwiGLU experts of ffn f (stacked weights, one GEMM pair per expert over the
             rows routed to it), the load-balancing loss added to the output's loss
    dense    a SwiGLU MLP of ffn k f (megatron.model.moe.swiglu on (2 k f, h) and (h, k f) weights): per token the
             same matrix FLOPs as the k experts a token passes through
Same hidden size, tokens (micro-batch x seq) and dtype.

Protocol: one step = forward and backward over a (micro-batch x seq, hidden) input, the loss the mean square of the
output (plus the MoE side's balancing loss). Each side runs --warmup steps, then --rounds rounds of --steps steps per
side, the order alternating every round; tokens/s of a round = steps x tokens / seconds, per wall-clock second and
per CPU second of this process (time.process_time). Printed: each side's median, the ratio MoE / dense of the
medians and the median of the rounds' ratios, the FLOPs ratio, and the 1-min load average before and after.

FLOP convention (megatron/model/flops.py's): matrix products only, forward + backward = 3 x forward. Per token:
    dense    3 x 6 h (k f)                      (SwiGLU: 2 h x 2kf + 2 kf x h)
    MoE      3 x (6 h f k + 2 h E)              (k experts, the router's h x E product)
The routing (top-k, softmax, sorting rows by expert, the weighted sum) is counted as no FLOPs: it is the MoE's cost
this figure shows.
"""
from __future__ import annotations

import argparse
import os
import statistics
from typing import Callable, Tuple

import torch

from llama_layer import timed  # bench/ is the script's folder
from megatron.model.moe import MoELayer, swiglu
from megatron.model.moe_config import MoEConfig


def moe_step(o: argparse.Namespace) -> Callable[[], None]:
    cfg = MoEConfig(num_experts=o.experts, ffn_hidden_size=o.expert_ffn, topk=o.topk, aux_loss_coeff=0.01,
                    capacity_factor=o.capacity_factor)
    torch.manual_seed(0)
    layer = MoELayer(cfg, o.hidden, expert_seed=1)
    x = torch.randn(o.micro_batch, o.seq, o.hidden, requires_grad=True)  # (b, s, h)

    def step() -> None:
        y, stats = layer(x)
        (y.square().mean() + stats["load_balancing_loss"]).backward()
    return step


def dense_step(o: argparse.Namespace) -> Callable[[], None]:
    ffn = o.topk * o.expert_ffn
    torch.manual_seed(0)
    fc1 = (torch.randn(2 * ffn, o.hidden) * 0.02).requires_grad_()  # (2f, h): gate rows, then up rows
    fc2 = (torch.randn(o.hidden, ffn) * 0.02).requires_grad_()      # (h, f)
    x = torch.randn(o.micro_batch * o.seq, o.hidden, requires_grad=True)  # (T, h)

    def step() -> None:
        swiglu(x, fc1, fc2).square().mean().backward()
    return step


def flops_per_token(o: argparse.Namespace) -> Tuple[float, float]:
    """(MoE, dense) model FLOPs of forward + backward per token (module docstring)."""
    return 3 * (6 * o.hidden * o.expert_ffn * o.topk + 2 * o.hidden * o.experts), \
        3 * 6 * o.hidden * o.topk * o.expert_ffn


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--expert-ffn", type=int, default=1024)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--capacity-factor", type=float, default=None, help="unset: dropless")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    o = p.parse_args()
    torch.set_num_threads(o.threads)
    load_before = os.getloadavg()[0]
    steps = {"dense": dense_step(o), "moe": moe_step(o)}
    for step in steps.values():
        timed(step, o.warmup)
    tokens = o.steps * o.micro_batch * o.seq
    rates = {name: [] for name in steps}  # per round: (wall tokens/s, CPU tokens/s)
    for r in range(o.rounds):
        for name in (("dense", "moe") if r % 2 == 0 else ("moe", "dense")):
            wall, cpu = timed(steps[name], o.steps)
            rates[name].append((tokens / wall, tokens / cpu))
    moe_flops, dense_flops = flops_per_token(o)
    routing = "dropless" if o.capacity_factor is None else f"capacity factor {o.capacity_factor}"
    print(f"hidden {o.hidden}, {o.experts} experts of ffn {o.expert_ffn}, top-{o.topk}, {routing}, against a dense "
          f"SwiGLU of ffn {o.topk * o.expert_ffn}; seq {o.seq}, micro-batch {o.micro_batch}, fp32, {o.threads} "
          f"thread(s); {o.rounds} rounds of {o.steps} steps per side after {o.warmup} warm-up steps")
    for k, unit in enumerate(("wall-clock", "CPU")):
        med = {name: statistics.median(x[k] for x in rates[name]) for name in rates}
        per_round = statistics.median(m[k] / d[k] for m, d in zip(rates["moe"], rates["dense"]))
        print(f"tokens per {unit} second: dense {med['dense']:8.0f} | MoE {med['moe']:8.0f} | ratio MoE / dense "
              f"{med['moe'] / med['dense']:.3f} (median of rounds' ratios {per_round:.3f})")
    print(f"model FLOPs per token (forward + backward): MoE {moe_flops / 1e6:.2f} M, dense {dense_flops / 1e6:.2f} M, "
          f"ratio MoE / dense {moe_flops / dense_flops:.4f}")
    print(f"cpu cores: {os.cpu_count()}, 1-min load average before/after: {load_before:.1f}/{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
