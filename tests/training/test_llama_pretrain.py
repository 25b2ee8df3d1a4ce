"""The Llama-style GPT (golden_cases.LLAMA: rope, RMSNorm, SwiGLU, grouped-query attention, no biases, untied head)
through `pretrain_gpt2.py`'s path, hidden and attention dropout on, 20 iterations, clipping active:

- pp = 2 with 1F1B, GPipe, interleaved (2 chunks per stage, full recomputation) and ZB-H1, and tp = 2 with
  --sequence-parallel and selective recomputation, give the per-iteration losses and gradient norms of (1, 1, 1)
  (fp32, relative error < 1e-5). (2, 2, 2) with ZeRO-1 is test_golden.py's (dropout off) and, with dropout on,
  tests/model/test_gpt_layer.py's (every dropout mask is the single process's: megatron/model/rng.py);
- a run saved at iteration 10 and resumed at (2, 2, 1) with --sequence-parallel continues with the
  uninterrupted run's losses bit for bit.
The golden file (tests/golden/llama_losses.json, dropout off) is checked by test_golden.py.
"""
import numpy as np
import pytest

from harness.dist import run_distributed
from tests.training.golden_cases import argv as golden_argv
from tests.training.golden_cases import preprocess

RTOL = 1e-5
ITERS, K = 20, 10
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--log-interval", "1"]
PP2 = [["--pipeline-schedule", "1f1b"], ["--pipeline-schedule", "gpipe"],
       ["--virtual-pipe-stages", "2", "--recompute-granularity", "full"], ["--pipeline-schedule", "zb-h1"]]


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    return preprocess(str(tmp_path_factory.mktemp("llama")))


def argv(prefix: str, tp: int, pp: int, extra=(), iters: int = ITERS, model: str = "llama") -> list:
    """golden_cases' run of `model` (a GPT layer of golden_cases.GPT_LAYERS) with 4 layers and dropout on."""
    out = golden_argv(model, prefix, tp, pp)
    out[out.index("--train-iters") + 1] = str(iters)
    out[out.index("--num-layers") + 1] = "4"
    return out + DROPOUT + list(extra)


def runs(argvs: list, world: int) -> list:
    """(losses, grad norms) of each argv, run one after the other on this rank."""
    from pretrain_gpt2 import DEFAULTS, SPEC
    from tests.training.runner import train_state
    return [(s.losses, s.grad_norms) for s in (train_state(a, world, SPEC, DEFAULTS) for a in argvs)]


def assert_same(got, want, what: str) -> None:
    assert len(got[0]) == len(want[0]) == ITERS, what
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, err_msg=f"{what}: losses")
    np.testing.assert_allclose(got[1], want[1], rtol=RTOL, err_msg=f"{what}: gradient norms")


@pytest.fixture(scope="module")
def single(data_prefix):
    return run_distributed(runs, 1, [argv(data_prefix, 1, 1)], 1, timeout=300)[-1][0]


def test_schedules_and_sequence_parallel_equal_one_process(data_prefix, single):
    variants = [argv(data_prefix, 1, 2, extra) for extra in PP2]
    variants.append(argv(data_prefix, 2, 1, ["--sequence-parallel", "--recompute-granularity", "selective"]))
    results = run_distributed(runs, 2, variants, 2, timeout=600)[-1]
    for extra, got in zip(PP2 + [["tp 2 --sequence-parallel selective"]], results):
        assert_same(got, single, " ".join(extra))
    assert (np.array(single[1]) > 0.3).all()  # clipping at 0.3 is active on every iteration


def _resume(base: list, save: str, world: int) -> dict:
    from pretrain_gpt2 import DEFAULTS, SPEC
    from tests.training.runner import train_state
    losses = lambda extra: train_state(base + extra, world, SPEC, DEFAULTS).losses  # noqa: E731
    return dict(straight=losses([]), first=losses(["--save", save, "--exit-interval", str(K)]),
                resumed=losses(["--load", save]))


def test_resume_is_exact(data_prefix, tmp_path):
    base = argv(data_prefix, 2, 2, ["--sequence-parallel", "--eval-interval", "2", "--eval-iters", "1"])
    out = run_distributed(_resume, 4, base, str(tmp_path / "ckpt"), 4, timeout=600)[-1]
    assert out["first"] == out["straight"][:K], "saving changed the losses"
    assert out["resumed"] == out["straight"][K:], f"resumed {out['resumed']} vs {out['straight'][K:]}"
