"""Training continues after a reshape exactly as the uninterrupted run (fp32, rel err < 1e-5), and --finetune.

GPT-2 and T5 train at (2, 2, 2) with ZeRO-1 for 10 iterations, saving at 5 (the session fixtures). The
iteration-5 checkpoint is then continued at (1, 2, 2), reshaped offline with the command line, and at
(4, 1, 1), by `--load` of the (2, 2, 2) checkpoint directly (reshape on load); same global batch. Iterations
6..10 must give the fixture's losses. Dropout is 0 (see tests/checkpoint/common.py: the dropout rule makes
masks depend on tp and dp, not on saved RNG state); a pp-only change keeps the default dropout (slow).

--finetune loads only the weights, at another layout: iteration 0, fresh optimizer and LR schedule, and the
first loss is the loaded model's loss on the first batch, computed here with the plain model.
"""
import os

import numpy as np
import pytest

from tests.checkpoint.common import argv, first_iteration_batches, mean_loss, train
from tests.checkpoint.conftest import SAVE_AT
from harness.dist import run_distributed
from tools.convert_checkpoint import run

RTOL = 1e-5


def _tag5_only(fixture: dict, root) -> str:
    """A directory whose `latest` names the iteration-5 folder of the fixture (linked, never modified)."""
    root.mkdir()
    tag = os.path.basename(fixture["tag5"])
    os.symlink(fixture["tag5"], root / tag)
    (root / "latest").write_text(tag)
    return str(root)


def _continue(model: str, fixture: dict, data_prefix: str, tmp_path) -> None:
    straight = fixture["losses"]
    offline = str(tmp_path / "reshaped_122")
    run(["reshape", "--load", fixture["dir"], "--tag", os.path.basename(fixture["tag5"]), "--save", offline,
         "--tensor-model-parallel-size", "1", "--pipe-parallel-size", "2", "--data-parallel-size", "2"])
    at_122 = train(model, data_prefix, (1, 2, 2), 10, ["--load", offline])
    on_load = _tag5_only(fixture, tmp_path / "at5")
    at_411 = train(model, data_prefix, (4, 1, 1), 10, ["--load", on_load])
    assert len(at_122) == len(at_411) == 10 - SAVE_AT
    np.testing.assert_allclose(at_122, straight[SAVE_AT:], rtol=RTOL, err_msg="(1,2,2) after offline reshape")
    np.testing.assert_allclose(at_411, straight[SAVE_AT:], rtol=RTOL, err_msg="(4,1,1) reshaped on --load")
    assert not any(name.startswith(".reshaped") for name in os.listdir(on_load))  # the work copy is removed


@pytest.mark.long
def test_gpt2_continues_after_reshape(gpt2_222, data_prefix, tmp_path):
    _continue("gpt2", gpt2_222, data_prefix, tmp_path)


@pytest.mark.slow
def test_t5_continues_after_reshape(t5_222, data_prefix, tmp_path):
    _continue("t5", t5_222, data_prefix, tmp_path)


def _reference_first_loss(model: str, args, load_dir: str) -> float:
    from megatron.checkpointing import load_model_weights, read_checkpoint_args
    from megatron.checkpointing.names import model_config
    from megatron.model import GPT2Model
    batches = first_iteration_batches(model, args)
    net = GPT2Model(model_config(read_checkpoint_args(load_dir)))
    load_model_weights(net, load_dir)
    return mean_loss(net.train(), batches)  # dropout is 0: train mode draws nothing


@pytest.mark.long
def test_finetune_loads_weights_only_at_another_layout(gpt2_222, data_prefix):
    """From the (2, 2, 2) checkpoint at iteration 10, --finetune at (2, 2, 1) starts at iteration 0."""
    extra = ["--load", gpt2_222["dir"], "--finetune"]
    losses = train("gpt2", data_prefix, (2, 2, 1), 3, extra)
    assert len(losses) == 3  # iterations 1..3: the saved iteration 10 was not restored
    reference = run_distributed(_reference_first_loss, 1, "gpt2", argv("gpt2", data_prefix, 1, 1, 3, extra),
                                gpt2_222["dir"])[0]
    np.testing.assert_allclose(losses[0], reference, rtol=RTOL)
    # the loaded weights are trained ones: far below the loss of the fresh model at iteration 1
    assert losses[0] < gpt2_222["losses"][0] - 0.05


@pytest.mark.slow
def test_pp_only_reshape_keeps_default_dropout(data_prefix, tmp_path):
    """Dropout 0.1 (the default): masks depend on (seed, iteration, micro-batch, site), not on tp or pp, so
    a (2, 2, 2) checkpoint continued at (2, 1, 2) matches the uninterrupted run."""
    dropout = ["--hidden-dropout", "0.1", "--attention-dropout", "0.1"]
    save = str(tmp_path / "ckpt")
    straight = train("gpt2", data_prefix, (2, 2, 2), 6, dropout + ["--save", save, "--save-interval", "3"])
    out = str(tmp_path / "pp1")
    run(["reshape", "--load", save, "--tag", "iter_0000003", "--save", out, "--tensor-model-parallel-size", "2",
         "--pipe-parallel-size", "1", "--data-parallel-size", "2"])
    resumed = train("gpt2", data_prefix, (2, 1, 2), 6, dropout + ["--load", out])
    np.testing.assert_allclose(resumed, straight[3:], rtol=RTOL)
