"""Throughput of the TDS PipelineEngine (1F1B, and with --schedules also interleaved and ZB-H1) against
DeepSpeed's own PipelineEngine at 1F1B, in one run.

Protocol: PP=2 (2 processes, 1 intra-op thread each, gloo on CPU), the same model, config, data and initial
weights for every engine, built side by side; `--warmup` steps each, then `--steps` timed steps each,
alternating the engines step by step (each step between barriers) so that load changes on a shared machine
hit all of them. Throughput is tokens/s = global_batch * seq_len / step time, from the median step time and
from the mean. The inter-stage tensor is one float hidden state (b, s, h), the case DeepSpeed handles, so
all engines run the same computation; TDS also prints its shape-header traffic (one header of 8*(2+10n)
bytes per activation hop) next to the payload traffic.

    .venv/bin/python bench/pipeline_engine.py [--steps 10 --warmup 3 --micro-batches 8 ...]
    .venv/bin/python bench/pipeline_engine.py --model gpt2 --schedules 1f1b interleaved zb-h1
    .venv/bin/python bench/pipeline_engine.py --model encoder --schedules zb-h1 1f1b

Models. `token` (default): embedding (V, h) -> L blocks x + W2 gelu(W1 x) (W1: h->2h) -> head (h, V);
cross-entropy loss. `encoder`: the same embedding and head around L plain nn.TransformerEncoderLayer(h,
heads, 4h, dropout 0, batch_first) (no TDS-specific layer: ZB-H1 defers their weight gradients through the
autograd graph, tds/pipe/graph_split.py). `gpt2`: the small GPT-2 of megatron/model (pre-LN transformer layers on the mpu
tensor-parallel linears, whose weight gradients ZB-H1 defers; learned positions; the word table tied to the
LM head across the two stages; dropout 0.1), with causal attention built inside each layer so that only the
hidden state crosses stages. Interleaved puts 2 chunks on each stage (the layers cut into 4 parts).
Model FLOPs per token (no recompute, convention 6N): 6 * (V*h*2 + L*4h^2) roughly (token model); only ratios
are reported, no MFU (a shared CPU has no meaningful peak).
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn as nn

from harness.spawn import run_on_ranks


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


def gpt2_config(args):
    from megatron.model.config import GPTConfig
    return GPTConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                      vocab_size=args.vocab, seq_length=args.seq, make_vocab_size_divisible_by=8, seed=1234)


def _gpt2_classes():
    """GPT-2 modules taking and returning the hidden state only (causal attention: mask None)."""
    from megatron.model.gpt2_model import GPT2Embedding, final_layernorm
    from megatron.model.transformer import TransformerLayer

    class GPT2Layer(TransformerLayer):
        def forward(self, x):  # (b, s, h) -> (b, s, h)
            return super().forward(x, None)

    class GPT2FinalNorm(nn.Module):
        def __init__(self, config):
            super().__init__()
            self.final_layernorm = final_layernorm(config)

        def forward(self, x):
            return self.final_layernorm(x)
    return GPT2Embedding, GPT2Layer, GPT2FinalNorm  # the embedding: (b, s) -> (b, s, h), positions 0..s-1


def specs(args):
    from deepspeed.pipe import LayerSpec, TiedLayerSpec
    if args.model == "gpt2":
        embed, layer, norm = _gpt2_classes()
        config, tied = gpt2_config(args), dict(tied_weight_attr="word_embeddings.weight")
        return ([TiedLayerSpec("embed", embed, config, **tied)]
                + [LayerSpec(layer, config, i + 1) for i in range(args.layers)] + [LayerSpec(norm, config)]
                + [TiedLayerSpec("embed", embed, config, forward_fn=embed.logits, **tied)])
    if args.model == "encoder":
        layer = [LayerSpec(nn.TransformerEncoderLayer, args.hidden, args.heads, 4 * args.hidden, dropout=0.0,
                           batch_first=True) for _ in range(args.layers)]
    else:
        layer = [LayerSpec(Block, args.hidden) for _ in range(args.layers)]
    return [LayerSpec(Embed, args.vocab, args.hidden)] + layer + [LayerSpec(Head, args.hidden, args.vocab)]


def partition(args) -> str:
    return {"gpt2": "type:GPT2Layer", "encoder": "type:TransformerEncoderLayer"}.get(args.model, "uniform")


def config(args, schedule: str = "1f1b") -> dict:
    cfg = {"train_micro_batch_size_per_gpu": args.mbs, "gradient_accumulation_steps": args.micro_batches,
           "train_batch_size": args.mbs * args.micro_batches, "steps_per_print": 10 ** 9,
           "gradient_clipping": 0.0, "zero_optimization": {"stage": 1}, "zero_allow_untested_optimizer": True}
    if schedule != "1f1b":
        cfg["pipeline"] = {"schedule": schedule, **({"virtual_stages": 2} if schedule == "interleaved" else {})}
    return cfg


def data(args):
    g = torch.Generator().manual_seed(0)
    items = [(torch.randint(0, args.vocab, (args.mbs, args.seq), generator=g),
              torch.randint(0, args.vocab, (args.mbs, args.seq), generator=g)) for _ in range(args.micro_batches)]
    while True:
        yield from items


def build_engine(name: str, args):
    """`name` is 'deepspeed' or 'tds <schedule>'."""
    import deepspeed

    import tds
    torch.manual_seed(1234)  # same initial weights for every engine
    if name.startswith("tds"):
        schedule = name.split()[1]
        model = tds.pipe.PipelineModule(specs(args), num_stages=2, loss_fn=cross_entropy,
                                        partition_method=partition(args), input_grad=[True], input_type=["float"],
                                        virtual_stages=2 if schedule == "interleaved" else 1)
        initialize, cfg = tds.initialize, config(args, schedule)
    else:
        model = deepspeed.pipe.PipelineModule(specs(args), num_stages=2, loss_fn=cross_entropy,
                                              partition_method=partition(args))
        initialize, cfg = deepspeed.initialize, config(args)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    engine, _, _, _ = initialize(model=model, optimizer=opt, config=cfg)
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
    engines = {name: build_engine(name, args) for name in [f"tds {s}" for s in args.schedules] + ["deepspeed"]}
    iters = {name: data(args) for name in engines}
    for _ in range(args.warmup):
        for name, engine in engines.items():
            engine.train_batch(iters[name])
    first = f"tds {args.schedules[0]}"
    engines[first].p2p.stats.reset()
    seconds = {name: [] for name in engines}
    losses = {}
    for _ in range(args.steps):
        for name, engine in engines.items():
            t, losses[name] = timed_step(engine, iters[name])
            seconds[name].append(t)
    tokens = args.mbs * args.micro_batches * args.seq
    out = {name: {"tokens_per_s": tokens / statistics.median(ts), "mean_tokens_per_s": tokens * len(ts) / sum(ts),
                  "loss": losses[name]} for name, ts in seconds.items()}
    s = engines[first].p2p.stats
    steps = args.steps
    out[first].update(header_bytes_per_step=s.header_bytes / steps, header_msgs_per_step=s.header_msgs / steps,
                      payload_bytes_per_step=s.payload_bytes / steps)
    return out


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
    p.add_argument("--heads", type=int, default=4, help="attention heads (gpt2)")
    p.add_argument("--model", choices=["token", "encoder", "gpt2"], default="token")
    p.add_argument("--schedules", nargs="+", default=["1f1b"], choices=["1f1b", "interleaved", "zb-h1", "gpipe"],
                   help="TDS schedules to run beside DeepSpeed's 1F1B (the first also reports header traffic)")
    args = p.parse_args()
    results = run_on_ranks(run, 2, args)
    print(f"config: {vars(args)}")
    ds = results["deepspeed"]
    for name, r in results.items():
        print(f"  {name:16s} tokens/s median-step {r['tokens_per_s']:9.1f}  mean {r['mean_tokens_per_s']:9.1f}  "
              f"final loss {r['loss']:.4f}")
    for name in (n for n in results if n != "deepspeed"):
        r = results[name]
        print(f"ratio {name} / DeepSpeed 1f1b: {r['tokens_per_s'] / ds['tokens_per_s']:.3f} (median step time), "
              f"{r['mean_tokens_per_s'] / ds['mean_tokens_per_s']:.3f} (mean)")
    t = results[f"tds {args.schedules[0]}"]
    print(f"TDS layout-change headers per step (after warm-up): {t['header_msgs_per_step']:.0f} messages, "
          f"{t['header_bytes_per_step']:.0f} bytes vs payload {t['payload_bytes_per_step']:.0f} bytes "
          f"({100 * t['header_bytes_per_step'] / t['payload_bytes_per_step']:.3f}%)")


if __name__ == "__main__":
    main()
