"""The default CPU job of examples/ds_pretrain_gpt2.sh built in a bench's rank: 8 gloo processes, (tp, pp, dp) =
(2, 2, 2), GPT-2 with 4 layers, hidden 64, 4 heads, seq 64, micro-batch 4 x gas 2, fp32, dropout on, ZeRO-1 unless
asked otherwise; and a way to train it N more iterations (the training loop itself, `megatron.training.loop`)."""
from __future__ import annotations

import time
from dataclasses import replace

import torch.distributed as dist

WORLD = 8


def default_job_argv(data: dict, iters: int, zero_stage: int = 1, extra: tuple = ()) -> list:
    return [*extra, "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
            "--max-position-embeddings", "64", "--micro-batch-size", "4", "--gas", "2", "--train-iters", str(iters),
            "--lr", "2e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--zero-stage", str(zero_stage),
            "--tensor-model-parallel-size", "2", "--pipe-parallel-size", "2", "--data-path", data["data_prefix"],
            "--vocab-file", data["vocab"], "--merge-file", data["merges"], "--num-workers", "0",
            "--log-interval", str(10 ** 6), "--eval-iters", "0", "--split", "98,1,1"]


class DefaultJob:
    """This rank's engine, config and training batches of the default job, planned for `iters` iterations."""

    def __init__(self, data: dict, iters: int, zero_stage: int = 1, extra: tuple = ()):
        from megatron.config.arguments import ENTRY_DEFAULTS, parse_args
        from megatron.logging_utils import TensorBoard
        from megatron.model.specs import spec_for
        from megatron.training.batches import BatchIterator
        from megatron.training.loop import TrainState
        from megatron.training.pretrain import data_loader, initialize_and_build, split_sample_counts
        spec = spec_for("gpt")
        args = parse_args(default_job_argv(data, iters, zero_stage, extra), defaults=ENTRY_DEFAULTS["gpt"], world_size=WORLD)
        self.engine, tokenizer, self.cfg, parallel = initialize_and_build(args, spec)
        datasets = spec.datasets(self.cfg.data, tokenizer, split_sample_counts(self.cfg.batch, 0))
        self.batches = BatchIterator(data_loader(datasets[0], 0, self.cfg, parallel),
                                     lambda raw: spec.get_batch(raw, data=self.cfg.data, tokenizer=tokenizer,
                                                                tp_group=parallel.tp_group))
        self.state, self.tb = TrainState(0, 0), TensorBoard(None)

    def train(self, n: int, exits) -> float:
        """`n` more iterations through the training loop after a barrier; seconds per iteration."""
        from megatron.training.loop import train
        dist.barrier()
        start = time.perf_counter()
        cfg = replace(self.cfg, batch=replace(self.cfg.batch, train_iters=self.state.iteration + n))
        train(self.engine, cfg, self.state, self.batches, None, self.tb, exits)
        return (time.perf_counter() - start) / n
