"""CPU tokens/s of the Llama family's GPT layer against GPT-2's layer of the same hidden size, in one run.

The ratio of the two is printed beside the ratio of their model FLOPs.

    python bench/llama_layer.py [--layers 4 --hidden 256 --heads 8 --groups 2 --seq 256 --micro-batch 4]
                                [--warmup 2 --steps 5 --rounds 7 --threads 1 --dropout 0.0 --dtype fp32]

The two stacks (megatron.model.transformer.TransformerLayer, tp = 1, one process):
    GPT-2    learned positions (outside the layer), LayerNorm, GELU-tanh MLP of ffn 4h, biases, multi-head attention
    Llama    rotary positions (applied in every layer), RMSNorm, SwiGLU of Megatron's default ffn int(8h/3/64) x 64,
             --groups key/value groups (grouped-query attention), no biases
Same hidden size, heads (kv_channels h / heads), layers, sequence, micro-batch, dropout (default 0: Llama's, and
SDPA's flash kernel on CPU for both) and dtype.

Protocol: one step = forward and backward of the stack of --layers layers over a (micro-batch, seq, hidden) input
with causal attention (the embedding, LM head, loss and optimizer are outside the comparison: they do not depend on
the layer's options, save the untied head). Each side runs --warmup steps, then --rounds rounds of --steps steps per
side, the order of the two sides alternating every round so that drift on the shared machine hits both; tokens/s
of a round = steps x micro-batch x seq / seconds, per wall-clock second and per CPU second of this process
(time.process_time: robust to other processes sharing the cores, exact with --threads 1). Printed: each side's
median over rounds, the ratio Llama / GPT-2 of the medians and the median of the rounds' ratios, and the 1-min load
average before and after.

FLOP convention (megatron/model/flops.py): model FLOPs of the layers' matmuls, forward + backward = 3 x forward,
no recomputation: per layer QKV 2 B s h (a + 2G) d, scores and values 4 B s^2 a d, output projection 2 B s h a d,
MLP 4 B s h f (GELU) or 6 B s h f (SwiGLU); norms, rotary positions, activations and softmax are not counted.
The FLOPs ratio is Llama / GPT-2 of those; the throughput ratio at equal efficiency would be its inverse.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable, Tuple

import torch

from megatron.model.config import GPTConfig
from megatron.model.flops import self_attention_layer_flops
from megatron.model.transformer import TransformerLayer

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def configs(o: argparse.Namespace) -> dict:
    """{'gpt2': GPTConfig, 'llama': GPTConfig} of the same sizes (module docstring)."""
    common = dict(num_layers=o.layers, hidden_size=o.hidden, num_attention_heads=o.heads, vocab_size=128,
                  seq_length=o.seq, hidden_dropout=o.dropout, attention_dropout=o.dropout, params_dtype=DTYPES[o.dtype])
    llama = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True, num_query_groups=o.groups,
                 add_bias_linear=False, tie_word_embeddings=False)
    return {"gpt2": GPTConfig(**common), "llama": GPTConfig(**common, **llama)}


def layer_flops_per_token(cfg: GPTConfig, micro_batch: int) -> float:
    """Model FLOPs of forward + backward of cfg.num_layers layers, per token."""
    per_layer = self_attention_layer_flops(micro_batch, cfg.seq_length, cfg.hidden_size,
                                           cfg.num_attention_heads * cfg.kv_channels, cfg.ffn_hidden_size,
                                           gated=cfg.swiglu, d_kv=cfg.num_query_groups * cfg.kv_channels)
    return 3 * cfg.num_layers * per_layer / (micro_batch * cfg.seq_length)


def step_fn(cfg: GPTConfig, micro_batch: int) -> Callable[[], None]:
    """One forward + backward of the stack; gradients accumulate into the same buffers every step."""
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(TransformerLayer(cfg, i + 1) for i in range(cfg.num_layers))
    x = torch.randn(micro_batch, cfg.seq_length, cfg.hidden_size).to(cfg.params_dtype).requires_grad_()  # (b, s, h)

    def step() -> None:
        y = x
        for layer in layers:
            y = layer(y)  # causal: is_causal=True, no mask
        y.float().square().mean().backward()
    return step


def timed(step: Callable[[], None], steps: int) -> Tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    return time.perf_counter() - wall, time.process_time() - cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=2, help="the Llama side's key/value groups")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout of both sides")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    o = p.parse_args()
    torch.set_num_threads(o.threads)
    load_before = os.getloadavg()[0]
    cfgs = configs(o)
    steps = {name: step_fn(cfg, o.micro_batch) for name, cfg in cfgs.items()}
    for step in steps.values():
        timed(step, o.warmup)
    tokens = o.steps * o.micro_batch * o.seq
    rates = {name: [] for name in steps}  # per round: (wall tokens/s, CPU tokens/s)
    for r in range(o.rounds):
        for name in (("gpt2", "llama") if r % 2 == 0 else ("llama", "gpt2")):
            wall, cpu = timed(steps[name], o.steps)
            rates[name].append((tokens / wall, tokens / cpu))
    flops = {name: layer_flops_per_token(cfg, o.micro_batch) for name, cfg in cfgs.items()}
    g, ll = cfgs["gpt2"], cfgs["llama"]
    print(f"layers {o.layers}, hidden {o.hidden}, heads {o.heads} (kv_channels {g.kv_channels}), seq {o.seq}, "
          f"micro-batch {o.micro_batch}, {o.dtype}, dropout {o.dropout}, {o.threads} thread(s); GPT-2: ffn "
          f"{g.ffn_hidden_size} (4h), LayerNorm, GELU, biases, {g.num_attention_heads} key/value heads; Llama: ffn "
          f"{ll.ffn_hidden_size} (int(8h/3/64) x 64) SwiGLU, RMSNorm, rope, no biases, {ll.num_query_groups} key/value "
          f"groups; {o.rounds} rounds of {o.steps} steps per side after {o.warmup} warm-up steps")
    for k, unit in enumerate(("wall-clock", "CPU")):
        med = {name: statistics.median(x[k] for x in rates[name]) for name in rates}
        per_round = statistics.median(lw[k] / gw[k] for lw, gw in zip(rates["llama"], rates["gpt2"]))
        print(f"tokens per {unit} second: GPT-2 layer {med['gpt2']:8.0f} | Llama layer {med['llama']:8.0f} | "
              f"ratio Llama / GPT-2 {med['llama'] / med['gpt2']:.3f} (median of rounds' ratios {per_round:.3f}); "
              f"GFLOP/s GPT-2 {med['gpt2'] * flops['gpt2'] / 1e9:.2f}, Llama {med['llama'] * flops['llama'] / 1e9:.2f}")
    print(f"model FLOPs per token (forward + backward of the {o.layers} layers): GPT-2 {flops['gpt2'] / 1e6:.2f} M, "
          f"Llama {flops['llama'] / 1e6:.2f} M, ratio Llama / GPT-2 {flops['llama'] / flops['gpt2']:.3f} "
          f"(equal FLOP/s would give a tokens/s ratio of {flops['gpt2'] / flops['llama']:.3f})")
    print(f"cpu cores: {os.cpu_count()}, 1-min load average before/after: {load_before:.1f}/{os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
