"""Exact resume with dropout on (the defaults, hidden and attention dropout 0.1), real GPT-2 and T5 through
`pretrain()`: K iterations then a checkpoint (`--exit-interval K --save`), then `--load` and on to K + N,
gives the per-iteration losses of the uninterrupted K + N run bit for bit. Evaluation runs every 2
iterations, so one evaluation falls before the save and one between the resume and the end.

Layouts (tp, pp, dp) = (1, 1, 1) (DeepSpeed's engine) and (2, 2, 2) (the TDS pipeline engine, ZeRO-1).
One run_distributed call per case runs the three trainings back to back on the same ranks.
"""
from __future__ import annotations

import pytest

from harness.dist import run_distributed
from tests.training.runner import small_argv, train_state

K, N = 3, 3
T5_SHAPE = ["--encoder-seq-length", "32", "--decoder-seq-length", "16", "--vocab-extra-ids", "8",
            "--tokenizer-type", "GPT2BPETokenizer"]


def _hooks(model: str):
    if model == "gpt2":
        from pretrain_gpt2 import DEFAULTS, SPEC
    else:
        from pretrain_t5 import DEFAULTS, SPEC
    return SPEC, DEFAULTS


def straight_and_resumed(model: str, argv: list, save: str, world_size: int) -> dict:
    """Per-iteration losses of: K + N straight; K then save; resume from the save to K + N."""
    hooks, defaults = _hooks(model)
    run = lambda extra: train_state(argv + extra, world_size, hooks, defaults).losses  # noqa: E731
    straight = run([])
    first = run(["--save", save, "--exit-interval", str(K)])
    resumed = run(["--load", save])
    return dict(straight=straight, first=first, resumed=resumed)


@pytest.mark.parametrize("model", ["gpt2", "t5"])
@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), pytest.param(2, 2, 2, marks=pytest.mark.long)])
def test_resume_with_dropout_is_exact(model, tp, pp, dp, gpt_data, tmp_path):
    extra = ["--eval-interval", "2", "--eval-iters", "1", "--log-interval", "1"]
    extra += T5_SHAPE if model == "t5" else []
    argv = small_argv(gpt_data, tp=tp, pp=pp, train_iters=K + N, extra=extra)
    assert "--hidden-dropout" not in argv and "--attention-dropout" not in argv  # the defaults: 0.1 each
    world = tp * pp * dp
    out = run_distributed(straight_and_resumed, world, model, argv, str(tmp_path / "ckpt"), world,
                          timeout=300)[-1]
    straight, first, resumed = out["straight"], out["first"], out["resumed"]
    assert len(straight) == K + N and len(first) == K and len(resumed) == N, out
    assert first == straight[:K], f"saving changed the losses: {first} vs {straight[:K]}"
    assert resumed == straight[K:], f"resumed {resumed} vs uninterrupted {straight[K:]}"
