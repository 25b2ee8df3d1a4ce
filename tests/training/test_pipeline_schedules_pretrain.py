"""Issue 12 through `pretrain`: the pipeline schedules as a user selects them (--pipeline-schedule zb-h1,
--virtual-pipe-stages 2, --pipeline-timeline), on GPT-2 (and T5, slow) with dropout on and tied embeddings.

- GPT-2 at pp = 2 with 1F1B, ZB-H1 and interleaved (2 chunks per stage, with activation checkpointing) gives
  the per-iteration losses and gradient norms of (1, 1, 1) (fp32, relative error < 1e-5; clipping at 0.3 is
  active on every iteration, so the norms must agree for the losses to). Pipeline layouts here; the other axes
  with dropout on are in test_llama_pretrain.py (every mask is the single process's on CPU, megatron/model/rng.py).
- --pipeline-timeline writes the trace of the chosen iteration, which tools/plot_pipeline.py reads.
- A checkpoint saved by the interleaved run at iteration 4 resumes with 1F1B (one chunk per stage: the loader
  reshapes it, since the stages hold other layers) and at pp = 1, continuing exactly as the uninterrupted run;
  `tools/convert_checkpoint.py inspect` names its chunks per stage.
"""
import json
import os

import numpy as np
import pytest

from harness.dist import run_distributed
from tests.training.golden_cases import argv as golden_argv
from tests.training.golden_cases import preprocess

RTOL = 1e-5
ITERS = 8
INTERLEAVED = ["--virtual-pipe-stages", "2", "--checkpoint-activations"]
ZB_H1 = ["--pipeline-schedule", "zb-h1"]


@pytest.fixture(scope="module")
def data_prefix(tmp_path_factory):
    return preprocess(str(tmp_path_factory.mktemp("schedules")))


def argv(model: str, prefix: str, pp: int, extra=(), layers: int = 4) -> list:
    """The golden run (committed corpus, clip 0.3) with dropout on, `layers` layers, ITERS iterations."""
    out = golden_argv(model, prefix, 1, pp)
    for flag, value in (("--num-layers", layers), ("--train-iters", ITERS), ("--hidden-dropout", 0.1),
                        ("--attention-dropout", 0.1), ("--log-interval", 1)):
        out[out.index(flag) + 1] = str(value)
    return out + list(extra)


def runs(model: str, argvs: list, world: int) -> list:
    """Per argv (run one after the other in each rank): (losses, grad norms) of the last rank."""
    if model == "gpt2":
        from pretrain_gpt2 import DEFAULTS, SPEC
    else:
        from pretrain_t5 import DEFAULTS, SPEC
    from tests.training.runner import train_state
    return [(s.losses, s.grad_norms) for s in (train_state(a, world, SPEC, DEFAULTS) for a in argvs)]


def assert_same(got, want, what: str) -> None:
    assert len(got[0]) == len(want[0]) > 0, what
    np.testing.assert_allclose(got[0], want[0], rtol=RTOL, err_msg=f"{what}: losses")
    np.testing.assert_allclose(got[1], want[1], rtol=RTOL, err_msg=f"{what}: gradient norms")


def assert_schedules_match_one_process(data_prefix: str, schedules: dict, what: str, timeout: int = 300) -> None:
    """GPT-2 at pp = 2 with each {name: extra flags} against one process with none (losses, gradient norms)."""
    (single,) = run_distributed(runs, 1, "gpt2", [argv("gpt2", data_prefix, 1)], 1, timeout=timeout)[0]
    piped = run_distributed(runs, 2, "gpt2", [argv("gpt2", data_prefix, 2, x) for x in schedules.values()], 2,
                            timeout=timeout)[-1]
    assert (np.array(single[1]) > 0.3).all()  # clipping active
    for name, got in zip(schedules, piped):
        assert_same(got, single, f"{what} {name}")


def test_gpt2_schedules_match_one_process_and_record_a_timeline(data_prefix, tmp_path):
    from tools import plot_pipeline
    trace = str(tmp_path / "zb.json")
    schedules = {"1f1b": [], "zb-h1": ZB_H1 + ["--pipeline-timeline", trace, "--pipeline-timeline-batches", "3"],
                 "interleaved": INTERLEAVED}
    assert_schedules_match_one_process(data_prefix, schedules, "GPT-2 pp=2")
    with open(trace) as f:
        meta = json.load(f)["otherData"]
    assert meta["schedule"] == "zb-h1" and meta["stages"] == 2 and meta["micro_batches"] == 4
    (fractions,) = plot_pipeline.main([trace])
    assert sorted(fractions) == [0, 1]


def test_interleaved_checkpoint_resumes_with_one_chunk_and_without_pipeline(data_prefix, tmp_path):
    save = str(tmp_path / "ckpt")
    (straight,) = run_distributed(runs, 2, "gpt2", [argv("gpt2", data_prefix, 2, INTERLEAVED + [
        "--save", save, "--save-interval", "4"])], 2, timeout=300)[-1]
    with open(os.path.join(save, "iter_0000004", "megatron_args.json")) as f:
        saved = json.load(f)
    assert saved["virtual_pipe_stages"] == 2 and saved["pipeline_schedule"] == "interleaved"
    from megatron.checkpointing.summary import inspect_lines
    assert "(tp, pp, dp)     (1, 2, 1), 2 model chunks per pipeline stage (interleaved)" in inspect_lines(save)
    with open(os.path.join(save, "latest"), "w") as f:  # resume from iteration 4 (the run also saved 8)
        f.write("iter_0000004")
    tail = (straight[0][4:], straight[1][4:])
    (one_chunk,) = run_distributed(runs, 2, "gpt2", [argv("gpt2", data_prefix, 2, ["--load", save])], 2,
                                   timeout=300)[-1]
    assert_same(one_chunk, tail, "interleaved checkpoint resumed with 1F1B at pp=2")
    (no_pipe,) = run_distributed(runs, 1, "gpt2", [argv("gpt2", data_prefix, 1, ["--load", save])], 1,
                                 timeout=300)[0]
    assert_same(no_pipe, tail, "interleaved checkpoint resumed at pp=1")


@pytest.mark.slow
def test_t5_schedules_and_the_other_checkpoint_direction(data_prefix, tmp_path):
    """T5 at pp = 2 under each schedule equals (1, 1, 1); a 1F1B GPT-2 checkpoint resumes interleaved at pp = 2
    and at pp = 4 (zb-h1)."""
    t5 = lambda pp, x=(): argv("t5", data_prefix, pp, x, layers=2)  # noqa: E731  (2 + 2 layers: 4 chunks)
    (single,) = run_distributed(runs, 1, "t5", [t5(1)], 1, timeout=300)[0]
    for name, got in zip(("zb-h1", "interleaved"),
                         run_distributed(runs, 2, "t5", [t5(2, ZB_H1), t5(2, INTERLEAVED)], 2, timeout=300)[-1]):
        assert_same(got, single, f"T5 pp=2 {name}")
    save = str(tmp_path / "ckpt")
    (straight,) = run_distributed(runs, 2, "gpt2", [argv("gpt2", data_prefix, 2, [
        "--save", save, "--save-interval", "4"])], 2, timeout=300)[-1]
    with open(os.path.join(save, "latest"), "w") as f:
        f.write("iter_0000004")
    tail = (straight[0][4:], straight[1][4:])
    (got,) = run_distributed(runs, 2, "gpt2", [argv("gpt2", data_prefix, 2, INTERLEAVED + ["--load", save])], 2,
                             timeout=300)[-1]
    assert_same(got, tail, "1F1B checkpoint resumed interleaved")
    (got,) = run_distributed(runs, 4, "gpt2", [argv("gpt2", data_prefix, 4, ZB_H1 + ["--load", save])], 4,
                             timeout=300)[-1]
    assert_same(got, tail, "1F1B checkpoint resumed with ZB-H1 at pp=4")
