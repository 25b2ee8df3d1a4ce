"""Framework overhead: the pretrain_gpt2 training path at (tp, pp, dp) = (1, 1, 1) against a minimal
plain-PyTorch loop training the same GPT-2 on the same data, in the same process.

    .venv/bin/python bench/framework_overhead.py [--layers 4 --hidden 256 --seq 128 --iters 20 --rounds 3]

Protocol: both sides start from identical weights (GPTModel's seeded initialisation) and read the same
micro-batches (same dataset, sampler and batch function). Each side runs --warmup iterations, then
--rounds rounds of --iters iterations, alternating framework / baseline so that machine noise hits both;
tokens/s per side is the median over rounds, measured two ways: per wall-clock second and per CPU second of
this process (time.process_time; robust to other processes sharing the machine, exact with --threads 1). One iteration = gas micro-batches of forward, backward, then
clipping (1.0) and an AdamW step with the linear-warm-up / cosine schedule.
  framework: megatron.training.loop.train (TDS engine, one stage, ZeRO stage --zero-stage, logging, grad norm)
  baseline:  for each micro-batch: loss = LMLoss(model(*inputs)); (loss / gas).backward();
             then clip_grad_norm_, optimizer.step(), scheduler.step(), zero_grad()
Prints tokens/s of each and the ratio framework / baseline (target >= 0.95), per wall-clock and CPU second.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from typing import Callable, Tuple

import torch

from megatron import mpu
from megatron.config.arguments import parse_args
from megatron.training.batches import BatchIterator
from megatron.training.learning_rates import AnnealingLR
from megatron.logging_utils import TensorBoard
from megatron.model.gpt2_model import GPTModel
from megatron.model.language_model import LMLoss
from megatron.training.optimizer import param_groups
from megatron.training.loop import TrainState, train
from megatron.training.pretrain import data_loader, initialize_and_build, split_sample_counts
from megatron.config.arguments import ENTRY_DEFAULTS
from megatron.model.specs import spec_for
from harness.example_data import build_data

DEFAULTS, SPEC = ENTRY_DEFAULTS["gpt"], spec_for("gpt")


def bench_args(opts, data: dict) -> argparse.Namespace:
    total = opts.warmup + opts.rounds * opts.iters
    argv = ["--num-layers", str(opts.layers), "--hidden-size", str(opts.hidden), "--num-attention-heads", "8",
            "--seq-length", str(opts.seq), "--micro-batch-size", str(opts.micro_batch), "--gas", str(opts.gas),
            "--train-iters", str(2 * total), "--lr", "3e-4", "--lr-warmup-iters", "5", "--lr-decay-style",
            "cosine", "--clip-grad", "1.0", "--zero-stage", str(opts.zero_stage), "--hidden-dropout", "0.1",
            "--attention-dropout", "0.1", "--data-path", data["data_prefix"], "--vocab-file", data["vocab"],
            "--merge-file", data["merges"], "--num-workers", "0", "--log-interval", str(10 ** 9),
            "--eval-iters", "0", "--split", "98,1,1"]
    if opts.deepspeed_config:
        argv += ["--deepspeed_config", opts.deepspeed_config]
    return parse_args(argv, defaults=DEFAULTS, world_size=1)


def plain_loop(args, data_iter, iters: int, model, optimizer, scheduler, loss_fn) -> None:
    for _ in range(iters):
        for _ in range(args.gas):
            inputs, labels = next(data_iter)
            (loss_fn(model(*inputs), labels) / args.gas).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--gas", type=int, default=2)
    p.add_argument("--zero-stage", type=int, default=1)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--deepspeed_config", default=None, help="a DeepSpeed JSON for the framework side")
    p.add_argument("--data-dir", default=None, help="reuse a corpus built here (default: a temporary dir)")
    opts = p.parse_args()
    torch.set_num_threads(opts.threads)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")

    data_dir = opts.data_dir or tempfile.mkdtemp(prefix="bench_")
    data = build_data(data_dir, max_mb=1.0, vocab_size=2048)
    args = bench_args(opts, data)
    engine, tokenizer, cfg, state = initialize_and_build(args, SPEC)
    datasets = SPEC.datasets(cfg.data, tokenizer, split_sample_counts(cfg.batch, cfg.logging.eval_iters))
    batch_fn = lambda raw: spec_for("gpt").get_batch(raw, cfg.data, tokenizer)  # noqa: E731
    framework_iter = BatchIterator(data_loader(datasets[0], 0, cfg, state), batch_fn)
    baseline_iter = BatchIterator(data_loader(datasets[0], 0, cfg, state), batch_fn)

    model = GPTModel(cfg.model).to(engine.device)
    opt, lr = cfg.optimizer, cfg.lr
    optimizer = torch.optim.AdamW(param_groups(model, opt.weight_decay), lr=opt.lr,
                                  betas=(opt.adam_beta1, opt.adam_beta2), eps=opt.adam_eps)
    scheduler = AnnealingLR(optimizer, lr.lr, lr.min_lr, lr.warmup, lr.decay, lr.style)
    loss_fn, tb, state = LMLoss(), TensorBoard(None), TrainState(0, 0)

    def timed(fn: Callable[[], None]) -> Tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        fn()
        return time.perf_counter() - wall, time.process_time() - cpu

    def run_framework(iters: int) -> Tuple[float, float]:
        run = replace(cfg, batch=replace(cfg.batch, train_iters=state.iteration + iters))
        return timed(lambda: train(engine, run, state, framework_iter, None, tb))

    def run_baseline(iters: int) -> Tuple[float, float]:
        return timed(lambda: plain_loop(args, baseline_iter, iters, model, optimizer, scheduler, loss_fn))

    run_framework(opts.warmup)
    run_baseline(opts.warmup)
    tokens = opts.iters * args.global_batch_size * args.seq_length
    fw, base = [], []
    for _ in range(opts.rounds):
        fw.append(run_framework(opts.iters))
        base.append(run_baseline(opts.iters))
    print(f"model: {args.num_layers} layers, hidden {args.hidden_size}, seq {args.seq_length}, micro-batch "
          f"{args.micro_batch_size} x gas {args.gas}, ZeRO stage {args.zero_stage}, {opts.threads} thread(s), "
          f"{mpu.get_data_parallel_world_size()} process, {opts.rounds} rounds of {opts.iters} iterations")
    for k, unit in enumerate(("wall-clock", "CPU")):
        f = statistics.median(tokens / t[k] for t in fw)
        b = statistics.median(tokens / t[k] for t in base)
        print(f"tokens per {unit} second: framework (pretrain_gpt2 path) {f:8.0f} | plain PyTorch loop {b:8.0f} "
              f"| ratio {f / b:.3f} (target >= 0.95)")


if __name__ == "__main__":
    main()
