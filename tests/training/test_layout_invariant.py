"""--layout-invariant (tds/pipe/fixed_order.py): GPT-2, the Llama-style GPT, a mixture of experts (golden_cases' "moe"
at ep 1, with sigmoid routing and the expert bias, which the checkpoint holds) and T5 through their entry points' path,
dropout 0.1, 20 iterations, micro-batch 2, global batch 8 (M = 4 micro-batches), fp32 at ZeRO stage 0: the losses and
gradient norms at full precision, and every weight of the checkpoint saved at iteration 20, are bit for bit those of
one process (dp, gas) = (1, 4) at (2, 2) and (4, 1) with tp = pp = 1, and at (pp, dp, gas) = (2, 1, 4) and (2, 2, 2).
GPT-2 and T5 (its three uses of one tied embedding) also at ZeRO stage 1 at every split with dp > 1
(tds/pipe/fixed_zero.py): the same bits as stage 0's one process. One run per world size trains the models back to
back. The negative control (without the flag the same splits differ in their last bits, within 1e-5) is
tests/faults/test_elastic_resume.py's; the fixed-order sums themselves are tests/tds/test_fixed_order.py's."""
from __future__ import annotations

import glob
import os

import pytest
import torch

from harness.dist import run_distributed
from tests.training.golden_cases import argv as golden_argv
from tests.training.golden_cases import preprocess, rank_run

pytestmark = pytest.mark.long
MODELS = ("gpt2", "llama", "t5", "moe")
ITERS = 20
FLAGS = ["--layout-invariant", "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--save-interval", str(ITERS)]
SPLITS = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 4: [(1, 4), (2, 2)]}  # world -> (pp, dp); gas = 4 / dp
ZERO1 = ("gpt2", "t5")  # also at ZeRO stage 1 where dp > 1 (at dp 1 ZeRO-1 runs as stage 0)
EXTRA = {"moe": ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias",
                 "--moe-router-bias-update-rate", "0.01"]}


def _cases(world: int) -> list:
    """(model, pp, dp, zero stage) of this world's runs."""
    return [(model, pp, dp, zero) for pp, dp in SPLITS[world] for zero in (0, 1) for model in MODELS
            if zero == 0 or (dp > 1 and model in ZERO1)]


def _folder(root: str, model: str, pp: int, dp: int, zero: int) -> str:
    return os.path.join(root, f"{model}_pp{pp}_dp{dp}_zero{zero}")


def _runs(prefix: str, root: str, world: int) -> dict:
    """{(model, pp, dp, zero): (losses, grad norms)} of this world's runs, on the last rank."""
    out = {}
    for model, pp, dp, zero in _cases(world):
        args = golden_argv(model, prefix, 1, pp, iters=ITERS, extra=[*FLAGS, "--zero-stage", str(zero),
                                                                     "--save", _folder(root, model, pp, dp, zero),
                                                                     *EXTRA.get(model, [])])
        out[(model, pp, dp, zero)] = rank_run(model, args, world)
    return out


def _weights(folder: str) -> dict:
    """{file: {name: tensor}} of the per-layer files of the checkpoint at iteration 20 (the same at every split)."""
    files = sorted(glob.glob(os.path.join(folder, f"iter_{ITERS:07d}", "layer_*-model_states.pt")))
    assert files, f"no layer files in {folder}"
    return {os.path.basename(f): torch.load(f, map_location="cpu", weights_only=True) for f in files}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("layout_invariant")
    prefix = preprocess(str(root))
    out = {}
    for world in SPLITS:
        out.update(run_distributed(_runs, world, prefix, str(root), world, timeout=900)[-1])
    return {"root": str(root), **out}


@pytest.mark.parametrize("model", MODELS)
def test_every_split_gives_the_bits_of_one_process(runs, model):
    one = runs[(model, 1, 1, 0)]
    assert len(one[0]) == len(one[1]) == ITERS and all(n is not None for n in one[1])
    weights = _weights(_folder(runs["root"], model, 1, 1, 0))
    if model == "moe":  # the expert bias moved, and the files below hold it
        assert any(key.endswith("expert_bias") and t.abs().max() > 0 for w in weights.values() for key, t in w.items())
    cases = [case for world in SPLITS for case in _cases(world) if case[0] == model][1:]
    assert len(cases) == (7 if model in ZERO1 else 4)
    for _, pp, dp, zero in cases:
        where = f"{model} at (pp, dp, gas) = ({pp}, {dp}, {4 // dp}), ZeRO stage {zero}"
        losses, norms = runs[(model, pp, dp, zero)]
        assert [x.hex() for x in losses] == [x.hex() for x in one[0]], f"{where}: losses differ from one process's"
        assert [x.hex() for x in norms] == [x.hex() for x in one[1]], f"{where}: gradient norms differ"
        folder = _folder(runs["root"], model, pp, dp, zero)
        zero_files = glob.glob(os.path.join(folder, f"iter_{ITERS:07d}", "zero_pp_rank_*_optim_states.pt"))
        assert len(zero_files) == (pp * dp if zero else 0), f"{where}: ZeRO-1's partition files {zero_files}"
        got = _weights(folder)
        assert got.keys() == weights.keys(), where
        for name, tensors in weights.items():
            for key, want in tensors.items():
                assert torch.equal(got[name][key], want), f"{where}: {name} {key} differs from one process's"
