"""One rank of the pp=2, dp=2 failure test (`python -m tests.tds.failure_job die|stall VICTIM TIMEOUT_S STAMP`).

The victim rank writes the time to STAMP, then dies (os._exit) or stalls (sleeps) in the forward of micro-batch
1 of batch 2; every other rank must raise, which exits this process non-zero with the traceback on stderr.
"""
from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

from tests.tds import common, harness


class Victim(torch.nn.Module):
    """Identity that, on the victim rank, dies or stalls at its `at`-th call."""

    def __init__(self, mode: str, victim: int, at: int, stamp: str):
        super().__init__()
        self.mode, self.victim, self.at, self.stamp, self.calls = mode, victim, at, stamp, 0

    def forward(self, x):
        self.calls += 1
        if dist.get_rank() == self.victim and self.calls == self.at:
            with open(self.stamp, "w") as f:
                f.write(repr(time.time()))
            if self.mode == "die":
                os._exit(1)
            time.sleep(3600)
        return x


def main(mode: str, victim: int, timeout_s: float, stamp: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    from tds.pipe import LayerSpec
    specs = common.stack_specs(2)
    specs.insert(3, LayerSpec(Victim, mode, victim, 4, stamp))  # batch 2 (gas 2 per dp rank), micro-batch 1
    engine = harness.build(specs, ([True], ["float"], [False]), pp=2, dp=2, gas=2, mbs=2,
                           pipeline={"timeout_s": timeout_s})
    X, Y = common.make_data(3, 8)
    data = common.rank_iterator(X, Y, engine.grid.get_data_parallel_rank(), 2, 2, 2)
    for _ in range(3):
        engine.train_batch(data)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4])
