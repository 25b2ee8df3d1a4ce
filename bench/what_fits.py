"""What fits: the planner's best layout for GPT-2 medium / large / XL and T5 base / large on 8 x 80 GB and
8 x 24 GB GPUs (predictions until a GPU run confirms them).

    python bench/what_fits.py [--global-batch-size 256] [--seq 1024]

Same library calls as tools/plan_layout.py (megatron.planning.search.rank_layouts), bf16, GPU attention
(memory-efficient SDPA, no s^2 term), DeepSpeed's default ZeRO-1 reduce buckets (5e8 elements, capped at the rank's
gradient elements as tds.initialize caps them).
"""
from __future__ import annotations

import argparse

from megatron.model.config import GPTConfig, T5Config
from megatron.planning.model_shape import ModelShape
from megatron.planning.search import rank_layouts
from megatron.planning.speed import GPUS, Cluster

MODELS = {  # configuration class and its fields, the sequence length set by --seq
    "GPT-2 medium (355M)": (GPTConfig, dict(num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=50257)),
    "GPT-2 large (774M)": (GPTConfig, dict(num_layers=36, hidden_size=1280, num_attention_heads=20, vocab_size=50257)),
    "GPT-2 XL (1.5B)": (GPTConfig, dict(num_layers=48, hidden_size=1600, num_attention_heads=25, vocab_size=50257)),
    "T5 base (220M)": (T5Config, dict(num_layers=12, hidden_size=768, num_attention_heads=12, vocab_size=32128)),
    "T5 large (770M)": (T5Config, dict(num_layers=24, hidden_size=1024, num_attention_heads=16, vocab_size=32128)),
}
CLUSTERS = {"8 x 80 GB (H100)": "h100", "8 x 24 GB (RTX 4090 class)": "rtx4090"}


def shape(model: tuple, seq: int) -> ModelShape:
    config_class, fields = model
    return ModelShape.of(config_class(**fields, seq_length=seq))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--global-batch-size", type=int, default=256)
    ap.add_argument("--seq", type=int, default=1024)
    a = ap.parse_args()
    print("| model | cluster | best layout (predicted fastest that fits) | peak per rank (GB) | of which "
          "activations | step (s) | bubble | layouts that fit |")
    print("|---|---|---|---|---|---|---|---|")
    for name, model in MODELS.items():
        for cname, gpu in CLUSTERS.items():
            mem, tflops, intra, inter = GPUS[gpu]
            c = Cluster(1, 8, mem, tflops, intra, inter)
            cands = rank_layouts(shape(model, a.seq), c, a.global_batch_size, "bf16")
            fits = [x for x in cands if x.fits]
            if not fits:
                print(f"| {name} | {cname} | none fits | {cands[0].peak / 1e9:.1f} (smallest) | | | | 0 |")
                continue
            best = fits[0]
            w = best.worst
            print(f"| {name} | {cname} | {best.layout.short()} | {best.peak / 1e9:.1f} | "
                  f"{(w.activations + w.working) / 1e9:.1f} | {best.step.total:.2f} | "
                  f"{best.step.bubble_fraction:.1%} | {len(fits)} of {len(cands)} |")


if __name__ == "__main__":
    main()
