"""Saved-activation memory of GPT-2 and T5 with and without activation checkpointing, and per transformer
layer under tensor and sequence parallelism with each recomputation, beside Korthikanti et al.'s formulas.

    python bench/activation_memory.py [--layers 8] [--hidden 256] [--heads 8] [--seq 256] [--batch 4]
                                      [--checkpoint-num-layers 1] [--dtype fp32|bf16] [--per-layer-only]

Part 2 (`layer_table`, bench/_layer_memory.py): one GPT-2 layer per tp rank, tp in {1, 2, 4} x sequence
parallelism off / on x recomputation none / selective / full; saved bytes per rank per micro-batch, term by
term, and the bytes through the collectives of one forward + backward.

Protocol: one training-mode forward (dropout 0.1) of the plain model (tp = pp = dp = 1, CPU) under
torch.autograd.graph.saved_tensors_hooks. "Saved bytes" = the bytes of the distinct storages autograd keeps
for backward at the end of the forward, parameters excluded, plus the inputs that mpu.checkpoint keeps for
each recomputed segment (non-reentrant checkpointing saves them outside autograd's hooks). During backward
a checkpointed run additionally holds one segment's activations at a time while it recomputes it.
The backward of both runs is then compared: the gradients must be identical (dropout replayed).
"""
from __future__ import annotations

import argparse

import torch

from megatron import mpu
from megatron.model.config import GPTConfig, T5Config
from megatron.model.gpt2_model import GPTModel
from megatron.model.t5_model import T5Model

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class SavedBytes:
    """Distinct non-parameter storages saved for backward (autograd hooks + checkpoint inputs)."""

    def __init__(self, model: torch.nn.Module):
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.storages: dict[int, int] = {}

    def add(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        if storage.data_ptr() not in self.params:
            self.storages[storage.data_ptr()] = storage.nbytes()

    def pack(self, t):
        if isinstance(t, torch.Tensor):
            self.add(t)
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


def batch(kind: str, cfg, b: int):
    g = torch.Generator().manual_seed(0)
    if kind == "gpt2":
        s = cfg.seq_length
        tokens = torch.randint(0, cfg.vocab_size, (b, s), generator=g)
        mask = torch.ones(s, s, dtype=torch.bool).triu(1).expand(b, 1, s, s)
        return (tokens, torch.arange(s).expand(b, s), mask), tokens
    se, sd = cfg.seq_length, cfg.decoder_seq_length
    enc = torch.randint(0, cfg.vocab_size, (b, se), generator=g)
    dec = torch.randint(0, cfg.vocab_size, (b, sd), generator=g)
    enc_mask = torch.zeros(b, 1, se, se, dtype=torch.bool)
    dec_mask = torch.ones(sd, sd, dtype=torch.bool).triu(1).expand(b, 1, sd, sd)
    return (enc, dec, enc_mask, dec_mask, torch.zeros(b, 1, sd, se, dtype=torch.bool)), dec


def measure(kind: str, cfg, b: int):
    """(saved bytes at the end of forward, gradients) for one forward + backward."""
    model = (GPTModel if kind == "gpt2" else T5Model)(cfg)
    inputs, labels = batch(kind, cfg, b)
    counter = SavedBytes(model)
    original = mpu.checkpoint

    def counting_checkpoint(function, *args):
        for a in args:
            if isinstance(a, torch.Tensor):
                counter.add(a)
        return original(function, *args)

    mpu.checkpoint = counting_checkpoint
    try:
        with torch.autograd.graph.saved_tensors_hooks(counter.pack, lambda t: t):
            loss = model.loss(model(*inputs), labels, torch.ones(labels.shape))
    finally:
        mpu.checkpoint = original
    saved = counter.total
    loss.backward()
    return saved, {n: p.grad for n, p in model.named_parameters()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1000)
    ap.add_argument("--checkpoint-num-layers", type=int, default=1)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--per-layer-only", action="store_true", help="only the per-layer tp x SP x recompute table")
    ap.add_argument("--attention-dropout", type=float, default=0.1, help="per-layer table (0: SDPA's fused kernel)")
    a = ap.parse_args()
    if a.per_layer_only:
        return layer_table(a)
    common = dict(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads, vocab_size=a.vocab,
                  seq_length=a.seq, hidden_dropout=0.1, attention_dropout=0.1, params_dtype=DTYPES[a.dtype])
    configs = {"gpt2": lambda n: GPTConfig(**common, checkpoint_num_layers=n),
               "t5": lambda n: T5Config(**common, decoder_seq_length=a.seq // 2, checkpoint_num_layers=n)}
    print(f"layers {a.layers} (T5: {a.layers} encoder + {a.layers} decoder), hidden {a.hidden}, heads {a.heads}, "
          f"seq {a.seq} (T5 decoder {a.seq // 2}), batch {a.batch}, {a.dtype}, dropout 0.1")
    print(f"{'model':6s} {'no checkpointing':>18s} {'checkpoint every ' + str(a.checkpoint_num_layers):>22s} "
          f"{'ratio':>7s}  gradients")
    for kind, make in configs.items():
        base, grads = measure(kind, make(0), a.batch)
        ckpt, grads_ckpt = measure(kind, make(a.checkpoint_num_layers), a.batch)
        same = all(torch.equal(g, grads_ckpt[n]) for n, g in grads.items())
        print(f"{kind:6s} {base / 2**20:15.1f} MiB {ckpt / 2**20:19.1f} MiB {ckpt / base:7.3f}  "
              f"{'identical' if same else 'DIFFERENT'}")
    layer_table(a)


def layer_table(a) -> None:
    from _layer_memory import print_layer_table  # bench/ is on the path when a script runs
    print_layer_table(seq=a.seq, batch=a.batch, hidden=a.hidden, heads=a.heads, dtype=a.dtype,
                      attention_dropout=a.attention_dropout)


if __name__ == "__main__":
    main()
