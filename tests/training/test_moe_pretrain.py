"""A mixture of experts through `pretrain_gpt2.py`'s path equals the single process at every layout (fp32, relative
error < 1e-5, 20 iterations, hidden and attention dropout on, clipping active): golden_cases.MOE with 4 layers whose
last two hold the experts (--moe-layer-freq [0,0,1,1]), so that a pipeline stage, and an interleaved chunk, holds no
MoE layer. 8 experts, top-2, a shared expert, the aux and z losses, an fp64 router. Compared: the losses, the
gradient norms (every expert counted once) and the logged load-balancing loss.

One 8-process launch runs, as (tp, pp, ep, dp):
- (1, 2, 2, 4): experts spread over data-parallel ranks (reduced over their expert-data-parallel group; the start-up
  broadcast within it), 1F1B;
- (2, 2, 2, 2) with --sequence-parallel: experts spread over the tensor-parallel ranks, each routing its part of the
  sequence (the aux loss's counts summed over them), the all-to-all dispatcher;
- (1, 2, 2, 4) with GPipe (and --check-replicas-interval 5: the experts' replicas are their expert-data-parallel
  group, the others' the data-parallel group, and neither reports a difference) and with ZB-H1 (the experts'
  gradients are computed in B: only the tensor-parallel layers defer theirs), and (2, 2, 2, 2) with
  --sequence-parallel interleaved (2 chunks per stage, full recomputation: the statistics are tallied once per
  micro-batch however often the forward runs; Megatron's seq_aux_loss, each sequence's counts summed over the
  tensor-parallel ranks holding its parts, against its own single process);
- (2, 2, 1, 2) with --sequence-parallel and ZeRO-1: experts on every rank, replicated parameters summed over tp;
- the capacity-dropping variant (factor 1.0: it drops) at (1, 2, 2, 4) against its own single process (capacity is
  counted over the tokens a router sees, so it depends on tp, as in Megatron).
Aux-loss-free balancing (sigmoid scores, the expert bias updated after each step from the counts summed over every
micro-batch and rank), 10 iterations at (dp, gas) = (4, 1) (pp 2) and (2, 2) (tp 2, pp 2, --sequence-parallel)
against (1, 4): the same losses and, read from the checkpoints saved at the end, the same biases bit for bit.
The (1, 1, 1) run is also the golden file's model (test_golden.py, 2 layers, dropout off). In the same launch the
(1, 2, 2, 4) run saved at iteration 10 (every expert and its Adam states in the files, gathered over the
expert-parallel group) resumes at its layout with the uninterrupted run's losses bit for bit, and at (2, 2, 2, 2)
with --sequence-parallel (another tp: reshaped) within 1e-5. That checkpoint then goes through a chain of loads and
saves without training, (tp, pp, ep) = (2, 2, 2) -> (1, 1, 1) (dp 8) -> (1, 2, 4): every weight and Adam state of
each save is bit-identical to the original's (read whole, `read_consolidated`).
"""
import os

import numpy as np
import pytest
import torch

from harness.dist import run_distributed
from tests.training.golden_cases import argv as golden_argv
from tests.training.golden_cases import preprocess

RTOL = 1e-5
ITERS = 20
DROPOUT = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--log-interval", "1", "--zero-stage", "0"]
EP2 = ["--expert-model-parallel-size", "2"]
CAPACITY = ["--moe-expert-capacity-factor", "1.0"]
SEQ_AUX = ["--moe-router-load-balancing-type", "seq_aux_loss"]
BIAS = ["--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--moe-router-bias-update-rate",
        "0.01", "--train-iters", "10"]
LAYOUTS = {  # name: (tp, pp, flags)
    "(1,2,2,4) 1f1b": (1, 2, EP2),
    "(2,2,2,2) sp alltoall": (2, 2, [*EP2, "--sequence-parallel", "--moe-token-dispatcher-type", "alltoall"]),
    "(1,2,2,4) gpipe": (1, 2, [*EP2, "--pipeline-schedule", "gpipe", "--check-replicas-interval", "5"]),
    "(1,2,2,4) zb-h1": (1, 2, [*EP2, "--pipeline-schedule", "zb-h1"]),
    "(2,2,2,2) sp interleaved full recompute seq_aux_loss": (2, 2, [*EP2, "--sequence-parallel",
                                                                    "--virtual-pipe-stages", "2",
                                                                    "--recompute-granularity", "full", *SEQ_AUX]),
    "(1,2,2,4) capacity": (1, 2, [*EP2, *CAPACITY]),
    "(1,2,1,4) expert bias": (1, 2, BIAS),
    "(2,2,1,2) sp expert bias": (2, 2, [*BIAS, "--sequence-parallel"]),
    "(2,2,1,2) sp zero-1": (2, 2, ["--sequence-parallel", "--zero-stage", "1"]),
}


def argv(prefix: str, tp: int, pp: int, extra=()) -> list:
    out = golden_argv("moe", prefix, tp, pp, iters=ITERS)
    out[out.index("--num-layers") + 1] = "4"
    out[out.index("--moe-layer-freq") + 1] = "[0,0,1,1]"
    return out + DROPOUT + list(extra)


def runs(argvs: list, world: int, save: str = None, chain: list = ()) -> list:
    """(losses, grad norms, logged load-balancing losses, dropped fractions, expert biases) of each argv, one after
    the other; with `save`, then the losses of the first argv saved at iteration 10 into `save`, of its resumption
    at its layout and at the second argv's, and then `save` loaded and saved again by each argv of `chain` in turn,
    into `save`-chain-i. The expert biases are read from the layer files of a run with the expert bias, saved at its
    end."""
    from pretrain_gpt2 import DEFAULTS, SPEC
    from tests.training.runner import train_state
    out = []
    for i, a in enumerate(argvs):
        folder = f"{save}-bias-{i}" if save and "--moe-router-enable-expert-bias" in a else None
        s = train_state(a + (["--save", folder] if folder else []), world, SPEC, DEFAULTS)
        out.append((s.losses, s.grad_norms, [m["load_balancing_loss"] for m in s.moe_metrics],
                    [m["dropped_fraction"] for m in s.moe_metrics], folder and _biases(folder)))
    if save:  # the first run saved at 10, resumed at its layout and at (2,2,2,2) --sequence-parallel
        first = train_state(argvs[0] + ["--save", save, "--exit-interval", "10"], world, SPEC, DEFAULTS).losses
        same = train_state(argvs[0] + ["--load", save], world, SPEC, DEFAULTS).losses
        other = train_state(argvs[1] + ["--load", save], world, SPEC, DEFAULTS).losses
        out.append((first, same, other))
        for i, a in enumerate(chain):
            _load_and_save(a, world, save if i == 0 else f"{save}-chain-{i - 1}", f"{save}-chain-{i}")
    return out


def _load_and_save(argv: list, world: int, load: str, save: str) -> None:
    """The checkpoint in `load` loaded at argv's layout and saved into `save`, nothing trained."""
    from megatron.checkpointing.engine_io import load_checkpoint, save_checkpoint
    from megatron.config.arguments import parse_args
    from megatron.training.pretrain import initialize_and_build
    from pretrain_gpt2 import DEFAULTS, SPEC
    args = parse_args(argv + ["--load", load, "--save", save], defaults=DEFAULTS, world_size=world)
    engine, _, cfg, _ = initialize_and_build(args, SPEC)
    save_checkpoint(engine, cfg, *load_checkpoint(engine, cfg))


def _biases(folder: str) -> list:
    """Every MoE layer's expert bias in the newest checkpoint of `folder`, in layer order."""
    import glob
    import os
    import torch
    tag = open(os.path.join(folder, "latest")).read().strip()
    out = []
    for path in sorted(glob.glob(os.path.join(folder, tag, "layer_*-model_states.pt"))):
        if "-model_0" in path and "-model_00-" not in path:
            continue  # another tensor-parallel rank's copy
        state = torch.load(path, weights_only=True)
        out += [v for k, v in state.items() if k.endswith("expert_bias")]
    return out


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    return preprocess(str(tmp_path_factory.mktemp("moe")))


@pytest.mark.long
def test_every_layout_equals_one_process_and_resumes_exactly(data_prefix, tmp_path):
    singles = run_distributed(runs, 1, [argv(data_prefix, 1, 1), argv(data_prefix, 1, 1, CAPACITY),
                                        argv(data_prefix, 1, 1, BIAS), argv(data_prefix, 1, 1, SEQ_AUX)], 1,
                              str(tmp_path / "single"), timeout=600)[-1][:4]
    variants = [argv(data_prefix, tp, pp, flags) for tp, pp, flags in LAYOUTS.values()]
    chain = [variants[1], argv(data_prefix, 1, 1, ["--micro-batch-size", "1"]),
             argv(data_prefix, 1, 2, ["--expert-model-parallel-size", "4"])]  # (2,2,2), (1,1,1), (1,2,4)
    save = str(tmp_path / "ckpt")
    results = run_distributed(runs, 8, variants, 8, save, chain, timeout=900)[-1]
    _assert_chain_bit_identical(save, len(chain))
    first, resumed, reshaped = results.pop()
    straight = results[0][0]
    assert first == straight[:10], "saving changed the losses"
    assert resumed == straight[10:], f"resumed {resumed} vs {straight[10:]}"
    np.testing.assert_allclose(reshaped, straight[10:], rtol=RTOL, err_msg="resumed at (2,2,2,2)")
    for name, got in zip(LAYOUTS, results):
        want = singles[1] if "capacity" in name else singles[2] if "bias" in name else \
            singles[3] if "seq_aux_loss" in name else singles[0]
        for i, what in enumerate(("losses", "gradient norms", "load-balancing losses")):
            assert len(got[i]) == len(want[i]) == (10 if "bias" in name else ITERS), f"{name}: {what}"
            np.testing.assert_allclose(got[i], want[i], rtol=RTOL, err_msg=f"{name}: {what}")
        if "bias" in name:  # (dp, gas) = (4, 1) and (2, 2) against (1, 4): the same bias, bit for bit
            assert len(got[4]) == len(want[4]) == 2 and all(map(torch.equal, got[4], want[4])), name
            assert all(b.abs().max() > 0 for b in want[4]), "the bias never moved"
    dropless, dropping, _, sequence_balanced = singles
    assert not np.allclose(dropless[2], sequence_balanced[2], rtol=RTOL)  # the two balancing losses differ
    assert max(dropless[3]) == 0.0 and min(dropping[3]) > 0.01, "the capacity factor 1.0 should drop choices"
    assert not np.allclose(dropless[0], dropping[0], rtol=RTOL)
    assert (np.array(dropless[1]) > 0.3).all()  # clipping at 0.3 is active on every iteration
    assert 0.9 < min(dropless[2]) and max(dropless[2]) < 1.5  # Megatron's definition: 1 at uniform routing


def _assert_chain_bit_identical(save: str, links: int) -> None:
    from megatron.checkpointing import read_latest
    from megatron.checkpointing.consolidated import read_consolidated

    def whole(folder: str):
        return read_consolidated(os.path.join(folder, read_latest(folder)))

    original = whole(save)
    assert any(".experts." in name for name in original.weights)
    for i in range(links):
        got = whole(f"{save}-chain-{i}")
        assert sorted(got.weights) == sorted(original.weights) and sorted(got.optim) == sorted(original.optim)
        for name, tensor in original.weights.items():
            assert torch.equal(got.weights[name], tensor), f"chain link {i}: weight {name} changed"
        for name, states in original.optim.items():
            for key, tensor in states.items():
                assert torch.equal(got.optim[name][key], tensor), f"chain link {i}: {key} of {name} changed"
