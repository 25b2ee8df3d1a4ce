"""--sequence-parallel through `pretrain()` (fp32, relative error < 1e-5 where layouts differ).

- Golden (slow): (tp, pp, dp) = (2, 2, 2), ZeRO-1, with --sequence-parallel gives the checked-in golden losses,
  GPT-2 and T5.
- Resume: GPT-2 at (2, 2, 1) with --sequence-parallel and hidden and attention dropout on, K iterations, save,
  resume to K + N: the losses of the uninterrupted run bit for bit. The same checkpoint loads without
  --sequence-parallel at the same tp (nothing about it is recorded as layout: the weights and optimizer
  state are the same tensors) and at tp = 1 (reshaped on load, as any tp change), and both continue with
  the uninterrupted run's losses: every dropout mask is layout-independent (a tp rank's heads draw the
  single process's attention-dropout masks of those heads).
"""
from __future__ import annotations

import json

import numpy as np
import pytest

from harness.dist import run_distributed
from tests.training.golden_cases import golden_path, preprocess, run
from tests.training.runner import small_argv, train_state

K, N = 3, 3
SP = ["--sequence-parallel"]
RTOL = 1e-5


@pytest.fixture(scope="module")
def golden_prefix(tmp_path_factory):
    return preprocess(str(tmp_path_factory.mktemp("golden_sp")))


@pytest.mark.slow  # 40 s each; the default suite's budget keeps the resume test below
@pytest.mark.parametrize("model", ["gpt2", "t5"])
def test_sequence_parallel_gives_the_golden_losses(model, golden_prefix):
    with open(golden_path(model)) as f:
        golden = np.array(json.load(f)["losses"])
    losses, _ = run(model, golden_prefix, 2, 2, 2, extra=SP)
    np.testing.assert_allclose(np.array(losses), golden, rtol=RTOL,
                               err_msg="(2, 2, 2) ZeRO-1 --sequence-parallel differs from the golden losses")


def _runs(argv: list, save: str, world_size: int) -> dict:
    from pretrain_gpt2 import DEFAULTS, SPEC
    run_ = lambda extra: train_state(argv + extra, world_size, SPEC, DEFAULTS).losses  # noqa: E731
    return dict(straight=run_(SP), first=run_(SP + ["--save", save, "--exit-interval", str(K)]),
                resumed=run_(SP + ["--load", save]), without=run_(["--load", save]))


def _load_at(argv: list, save: str, world_size: int) -> list:
    from pretrain_gpt2 import DEFAULTS, SPEC
    return train_state(argv + ["--load", save], world_size, SPEC, DEFAULTS).losses


@pytest.mark.long
def test_resume_exact_and_load_without_sequence_parallel(gpt_data, tmp_path):
    extra = ["--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1", "--hidden-dropout", "0.1",
             "--attention-dropout", "0.1"]
    save = str(tmp_path / "ckpt")
    argv = small_argv(gpt_data, tp=2, pp=2, train_iters=K + N, extra=extra)
    out = run_distributed(_runs, 4, argv, save, 4, timeout=600)[-1]
    straight, first, resumed, without = out["straight"], out["first"], out["resumed"], out["without"]
    assert len(straight) == K + N and len(first) == K and len(resumed) == len(without) == N, out
    assert first == straight[:K], f"saving changed the losses: {first} vs {straight[:K]}"
    assert resumed == straight[K:], f"resumed {resumed} vs uninterrupted {straight[K:]}"
    np.testing.assert_allclose(without, straight[K:], rtol=RTOL, err_msg="loaded without --sequence-parallel")
    argv_tp1 = small_argv(gpt_data, tp=1, pp=2, train_iters=K + N, extra=extra)
    at_tp1 = run_distributed(_load_at, 2, argv_tp1, save, 2, timeout=600)[-1]
    np.testing.assert_allclose(at_tp1, straight[K:], rtol=RTOL, err_msg="loaded at tp = 1 without it")
