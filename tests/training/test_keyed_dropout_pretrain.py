"""--keyed-dropout through the entry points' path (golden_cases.rank_run): GPT-2 and T5, hidden and attention
dropout 0.1, 10 iterations, global batch 8, fp32, ZeRO-1: the losses at micro-batch 1, and at tp = 2 with
--sequence-parallel (each rank drawing its heads', rows' or feed-forward columns' numbers only), equal those at
micro-batch 2 on one process within 1e-5 (the masks are the same; only the GEMMs' shapes differ). The masks
themselves: tests/model/test_keyed_dropout.py."""
from __future__ import annotations

import numpy as np
import pytest

from harness.dist import run_distributed
from tests.training.golden_cases import argv as golden_argv
from tests.training.golden_cases import preprocess, rank_run

pytestmark = pytest.mark.long
ITERS = 10
FLAGS = ["--keyed-dropout", "--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
MODELS = ("gpt2", "t5")


def _runs(prefix: str, world: int) -> dict:
    out = {}
    for model in MODELS:
        if world == 1:
            for mbs in (2, 1):
                args = golden_argv(model, prefix, 1, 1, iters=ITERS, extra=[*FLAGS, "--micro-batch-size", str(mbs)])
                out[(model, f"micro-batch {mbs}")] = rank_run(model, args, world)[0]
        else:
            args = golden_argv(model, prefix, 2, 1, iters=ITERS, extra=[*FLAGS, "--sequence-parallel"])
            out[(model, "tp 2, sequence parallel")] = rank_run(model, args, world)[0]
    return out


def test_micro_batch_size_and_tensor_splits_keep_the_masks(tmp_path):
    prefix = preprocess(str(tmp_path))
    losses = {}
    for world in (1, 2):
        losses.update(run_distributed(_runs, world, prefix, world, timeout=600)[-1])
    for model in MODELS:
        want = losses[(model, "micro-batch 2")]
        assert len(want) == ITERS
        for other in ("micro-batch 1", "tp 2, sequence parallel"):
            got = losses[(model, other)]
            np.testing.assert_allclose(got, want, rtol=1e-5, err_msg=f"{model}, {other}")
            gap = max(abs(a / b - 1) for a, b in zip(got, want))
            print(f"{model}, {other}: largest relative loss difference from micro-batch 2: {gap:.2e}")
