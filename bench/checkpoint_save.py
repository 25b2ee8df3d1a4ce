"""How long a save blocks the training loop: synchronous against --async-save, same model, same run.

    python bench/checkpoint_save.py                      # GPT-2 8 layers, hidden 1024: ~1.25 GB per checkpoint
    python bench/checkpoint_save.py --layers 4 --saves 2  # smaller and shorter

Protocol: one process, (tp, pp, dp) = (1, 1, 1), fp32, a GPT-2 built on the fly (vocabulary 2048 on a corpus
made here) with its AdamW state, trained through `megatron.training.loop.train` (the TDS engine). One
warm-up iteration, then two phases of --saves rounds each: --steps real training iterations, then
`megatron.checkpointing.save_checkpoint` into a fresh tag folder, timed on the wall clock from the call to its
return (the time the loop is blocked). Phase 1 saves synchronously (DeepSpeed's torch.save of every file,
manifest, `latest`); phase 2 with --async-save (the state copied to host memory, the writes handed to a
background thread; a save that finds the previous one unfinished waits for it, and that wait is counted).
After phase 2, `wait_for_saves` is timed too (the run's exit would wait that long). The background write
shares the CPU with training: the mean iteration time of each phase is printed beside the blocked times.
Printed: checkpoint GB, each save's blocked seconds, their medians and the ratio async / sync.
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from typing import Callable, List, Tuple

import torch

from megatron.checkpointing import save_checkpoint, wait_for_saves
from megatron.checkpointing.files import checkpoint_tag, folder_bytes
from megatron.config.arguments import ENTRY_DEFAULTS, parse_args
from megatron.logging_utils import TensorBoard
from megatron.model.specs import spec_for
from megatron.training.batches import BatchIterator
from megatron.training.loop import TrainState, train
from megatron.training.pretrain import data_loader, initialize_and_build, split_sample_counts
from harness.example_data import build_data

DEFAULTS, SPEC = ENTRY_DEFAULTS["gpt"], spec_for("gpt")


def bench_args(opts, data: dict, save: str) -> argparse.Namespace:
    iters = 1 + 2 * opts.saves * opts.steps
    argv = ["--num-layers", str(opts.layers), "--hidden-size", str(opts.hidden), "--num-attention-heads", "16",
            "--seq-length", str(opts.seq), "--micro-batch-size", "1", "--global-batch-size", "1",
            "--train-iters", str(iters), "--lr", "3e-4", "--lr-warmup-iters", "1", "--lr-decay-style", "cosine",
            "--zero-stage", "1", "--data-path", data["data_prefix"], "--vocab-file", data["vocab"],
            "--merge-file", data["merges"], "--num-workers", "0", "--log-interval", str(10 ** 9),
            "--eval-iters", "0", "--split", "98,1,1", "--save", save]
    return parse_args(argv, defaults=DEFAULTS, world_size=1)


def timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--saves", type=int, default=3, help="saves per phase")
    p.add_argument("--steps", type=int, default=4, help="training iterations before each save")
    p.add_argument("--workdir", default=None, help="where to write (default: a temporary directory)")
    opts = p.parse_args()
    torch.set_num_threads(1)
    os.environ.setdefault("DS_ACCELERATOR", "cpu" if not torch.cuda.is_available() else "cuda")
    root = tempfile.mkdtemp(prefix="save_bench_", dir=opts.workdir)
    try:
        data = build_data(os.path.join(root, "data"), max_mb=0.3, vocab_size=2048)
        engine, tokenizer, cfg, parallel = initialize_and_build(bench_args(opts, data, os.path.join(root, "ckpt")),
                                                                SPEC)
        datasets = SPEC.datasets(cfg.data, tokenizer, split_sample_counts(cfg.batch, cfg.logging.eval_iters))
        batches = BatchIterator(data_loader(datasets[0], 0, cfg, parallel),
                                lambda raw: spec_for("gpt").get_batch(raw, cfg.data, tokenizer))
        state, tb = TrainState(0, 0), TensorBoard(None)

        def steps(n: int) -> float:
            run = replace(cfg, batch=replace(cfg.batch, train_iters=state.iteration + n))
            return timed(lambda: train(engine, run, state, batches, None, tb)) / n

        def phase(async_save: bool) -> Tuple[List[float], List[float]]:
            run = replace(cfg, checkpoint=replace(cfg.checkpoint, async_save=async_save))
            blocked, step_s = [], []
            for _ in range(opts.saves):
                step_s.append(steps(opts.steps))
                blocked.append(timed(lambda: save_checkpoint(engine, run, state.iteration,
                                                             state.consumed_train_samples)))
            return blocked, step_s

        steps(1)
        sync, sync_steps = phase(False)
        gb = folder_bytes(os.path.join(cfg.checkpoint.save, checkpoint_tag(1 + opts.steps))) / 1e9
        asynchronous, async_steps = phase(True)
        final_wait = timed(wait_for_saves)
        params = sum(t.numel() for t in engine.module.parameters()) / 1e6
        print(f"checkpoint: GPT-2 {opts.layers} layers, hidden {opts.hidden}, {params:.1f} M parameters, fp32 with "
              f"AdamW moments: {gb:.2f} GB; {opts.saves} saves per mode, each after {opts.steps} iterations")
        for name, blocked, step_s in (("sync ", sync, sync_steps), ("async", asynchronous, async_steps)):
            print(f"{name}: blocked per save {', '.join(f'{t:.2f}' for t in blocked)} s (median "
                  f"{statistics.median(blocked):.2f} s); mean iteration {statistics.mean(step_s):.2f} s")
        print(f"async: wait_for_saves after the last save {final_wait:.2f} s")
        print(f"blocked time async / sync = {statistics.median(asynchronous) / statistics.median(sync):.3f} "
              f"(medians)")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
