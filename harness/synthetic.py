"""A checkpoint made without training: GPT-2 / T5 weights from the model's own initialisation, Adam moments
and fp32 master weights filled with random values, written at any layout by the library's writer (which the
identity tests check against the files DeepSpeed writes). For tests that need odd shapes and for
bench/reshape_checkpoint.py (a checkpoint of several GB in seconds)."""
from __future__ import annotations

import os
from typing import Dict, Sequence

import torch

from megatron.checkpointing.consolidated import Consolidated
from megatron.config.run_config import json_record
from megatron.checkpointing.names import ModelTable, model_config
from megatron.checkpointing.optim import default_extras
from megatron.checkpointing.reshape import write_checkpoint
from megatron.model.config import padded_vocab_size
from harness import ROOT

TAG = "iter_0000010"
DATA = os.path.join(ROOT, "tests", "golden", "data")  # the golden runs' committed tokenizer


def resolved_args(model: str, layout: Sequence[int], vocab_size: int, layers: int = 2, hidden: int = 32,
                  heads: int = 4, extra: Sequence[str] = ()) -> Dict:
    """The megatron_args.json a run at `layout` = (tp, pp, dp) would save (parse_args resolves everything)."""
    from megatron.config.arguments import parse_args
    tp, pp, dp = layout
    shape = ["--seq-length", "32"] if model == "gpt2" else ["--encoder-seq-length", "32", "--decoder-seq-length", "16"]
    shape += ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads)]
    argv = ["--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "10", "--lr", "1e-3",
            "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(DATA, "vocab.json"),
            "--merge-file", os.path.join(DATA, "merges.txt"), "--make-vocab-size-divisible-by", "8",
            "--tensor-model-parallel-size", str(tp), "--pipe-parallel-size", str(pp), *shape, *extra]
    defaults = dict(model_type="gpt" if model == "gpt2" else "t5", layernorm_epsilon=1e-5 if model == "gpt2" else 1e-6)
    args = json_record(parse_args(argv, defaults=defaults, world_size=tp * pp * dp))
    args.update(vocab_size=vocab_size, padded_vocab_size=padded_vocab_size(vocab_size, 8, tp))
    return args


def _hyper(weight_decay: float) -> Dict:
    group = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-3, weight_decay=weight_decay).param_groups[0]
    return {k: v for k, v in group.items() if k != "params"}


def synthetic(args: Dict, seed: int = 0) -> Consolidated:
    """Weights as the model initialises them (tp = 1), random optimizer state, engine state at iteration 10."""
    from deepspeed.git_version_info import version
    from megatron.model import GPT2Model, T5Model
    model = (GPT2Model if args["model_type"] == "gpt" else T5Model)(model_config(args))  # tp = 1
    weights = {n: p.detach() for n, p in model.named_parameters()}
    g = torch.Generator().manual_seed(seed)
    optim = {n: {"fp32": w.clone(), "exp_avg": torch.randn(w.shape, generator=g) * 1e-3,
                 "exp_avg_sq": torch.rand(w.shape, generator=g) * 1e-6} for n, w in weights.items()}
    table = ModelTable(args)
    for n, info in table.by_name.items():  # the padded rows a run at this tp would hold
        if info.vocab:
            rows = args["padded_vocab_size"]
            weights[n] = torch.cat([weights[n], torch.zeros(rows - weights[n].size(0), weights[n].size(1))])[:rows]
            optim[n] = {k: torch.cat([v, torch.zeros(rows - v.size(0), v.size(1))])[:rows] for k, v in optim[n].items()}
    engine = dict(buffer_names=[], lr_scheduler=dict(num_steps=10, max_lr=1e-3, min_lr=0.0, warmup_iters=0,
                                                     decay_iters=10, decay_style="linear"),
                  data_sampler=None, random_ltd=None, skipped_steps=0, global_steps=10, global_samples=80,
                  ds_version=version, iteration=10, consumed_train_samples=80)
    return Consolidated(args=args, weights=weights, optim=optim,
                        hyper={"decay": _hyper(args["weight_decay"]), "no_decay": _hyper(0.0)},
                        step={"decay": torch.tensor(10.0), "no_decay": torch.tensor(10.0)},
                        extras=default_extras(args, 10, 0), engine=engine)


def write_synthetic(save_dir: str, args: Dict, seed: int = 0) -> str:
    """A checkpoint directory (`latest` -> iter_0000010) at the layout of `args`; returns save_dir."""
    write_checkpoint(synthetic(args, seed), save_dir, TAG, args)
    return save_dir
