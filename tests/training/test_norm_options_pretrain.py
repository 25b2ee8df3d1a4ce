"""The GPT layer's norm options (issue 40) through `pretrain_gpt2.py`'s path, as test_llama_pretrain.py runs the
Llama-style GPT (4 layers, hidden and attention dropout on, 20 iterations, clipping active): Qwen3's layer
(golden_cases.QWEN3: the Llama layer with per-head query / key norms, heads of width 12) and OLMo-2's
(golden_cases.OLMO2: the Llama layer with an RMSNorm over all heads' queries and keys, split over tp, and the
norms after the sublayers, dropout after them).

- pp = 2 with 1F1B, GPipe, interleaved (2 chunks per stage, full recomputation) and ZB-H1, tp = 2 with
  --sequence-parallel and selective recomputation, and (2, 2, 2) with ZeRO-1, --sequence-parallel and full or
  selective recomputation give the per-iteration losses and gradient norms of (1, 1, 1) (fp32, relative error
  < 1e-5);
- a run saved at iteration 10 and resumed at (2, 2, 1) with --sequence-parallel continues with the uninterrupted
  run's losses bit for bit, and its checkpoint reshaped (2,2,1) -> (1,1,1) -> (2,1,2) -> (1,2,1) -> (2,2,1) comes
  back bit for bit.
All long (test_gpt_layer.py runs the layers on the engine at tp 2 with sequence parallelism in make test); the
golden files (dropout off, (1, 1, 1)) are checked by test_golden.py.
"""
import os

import pytest

from harness.dist import run_distributed
from tests.training.golden_cases import preprocess
from tests.training.test_llama_pretrain import ITERS, K, PP2, _resume, argv, assert_same, runs

MODELS = ("qwen3", "olmo2")
pytestmark = pytest.mark.long


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    return preprocess(str(tmp_path_factory.mktemp("norm_options")))


@pytest.fixture(scope="module")
def single(data_prefix):
    """model -> (losses, grad norms) at (1, 1, 1)."""
    got = run_distributed(runs, 1, [argv(data_prefix, 1, 1, model=m) for m in MODELS], 1, timeout=600)[-1]
    return dict(zip(MODELS, got))


def test_schedules_and_sequence_parallel_equal_one_process(data_prefix, single):
    variants = PP2 + [["tp 2 --sequence-parallel selective"]]
    argvs = [argv(data_prefix, 1, 2, extra, model=m) for m in MODELS for extra in PP2]
    argvs += [argv(data_prefix, 2, 1, ["--sequence-parallel", "--recompute-granularity", "selective"], model=m)
              for m in MODELS]
    results = run_distributed(runs, 2, argvs, 2, timeout=900)[-1]
    named = [(m, v) for m in MODELS for v in PP2] + [(m, variants[-1]) for m in MODELS]
    assert len(results) == len(named)
    for (model, extra), got in zip(named, results):
        assert_same(got, single[model], f"{model} {' '.join(extra)}")


def test_3d_zero1_equals_one_process(data_prefix, single):
    """(2, 2, 2) with ZeRO-1 and --sequence-parallel; Qwen3's layer with full recomputation, OLMo-2's with
    selective."""
    recompute = {"qwen3": ["--checkpoint-activations"], "olmo2": ["--recompute-granularity", "selective"]}
    argvs = [argv(data_prefix, 2, 2, ["--sequence-parallel", *recompute[m]], model=m) for m in MODELS]
    results = run_distributed(runs, 8, argvs, 8, timeout=900)[-1]
    for model, got in zip(MODELS, results):
        assert_same(got, single[model], f"{model} (2, 2, 2) ZeRO-1 --sequence-parallel {' '.join(recompute[model])}")


def _reshape_chain(save: str, out: str) -> tuple:
    """The checkpoint of `save` through the chain back to (2, 2, 1): (files before, files after), RNG states gone."""
    from tests.checkpoint.common import differences, load_all
    from tests.checkpoint.test_reshape import _tag_folder, _without_rng, reshape
    current = save
    for i, layout in enumerate([(1, 1, 1), (2, 1, 2), (1, 2, 1), (2, 2, 1)]):
        current = reshape(current, os.path.join(out, f"step{i}"), layout)
    original, back = load_all(_tag_folder(save)), load_all(_tag_folder(current))
    return sorted(original) == sorted(back), differences(_without_rng(original), back)


@pytest.mark.parametrize("model", MODELS)
def test_resume_is_exact_and_reshape_round_trips(model, data_prefix, tmp_path):
    base = argv(data_prefix, 2, 2, ["--sequence-parallel", "--eval-interval", "2", "--eval-iters", "1"], model=model)
    save = str(tmp_path / "ckpt")
    out = run_distributed(_resume, 4, base, save, 4, timeout=900)[-1]
    assert len(out["straight"]) == ITERS
    assert out["first"] == out["straight"][:K], "saving changed the losses"
    assert out["resumed"] == out["straight"][K:], f"resumed {out['resumed']} vs {out['straight'][K:]}"
    same_files, differences = _reshape_chain(save, str(tmp_path / "reshaped"))
    assert same_files and differences == []
