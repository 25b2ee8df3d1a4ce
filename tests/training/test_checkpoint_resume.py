"""Checkpoints: a crash before `latest` moves, exact resume (pipeline layout), shape mismatch errors.

Toy model (tests/training/toy_model.py) with dropout, so resuming must also restore the RNG streams;
layout (tp, pp, dp) = (1, 2, 2) on 4 gloo ranks with ZeRO-1.
"""
import os

import pytest

import megatron.checkpointing as ck
from harness.dist import run_distributed
from tests.training.runner import small_argv, train_losses

PIPE = dict(tp=1, pp=2)
DROPOUT = ["--hidden-dropout", "0.1"]


def _straight(data):
    return run_distributed(train_losses, 4, small_argv(data, train_iters=20, extra=DROPOUT, **PIPE), 4,
                           timeout=240)[-1]


class SimulatedCrash(RuntimeError):
    pass


def _crash_on_second_commit(argv, world_size):
    """Every rank dies after the files of the second checkpoint are written, before `latest` moves."""
    calls = []
    real_commit = ck.engine_io.commit

    def commit(save_dir, tag):
        calls.append(tag)
        if len(calls) == 2:
            raise SimulatedCrash(tag)
        real_commit(save_dir, tag)

    ck.engine_io.commit = commit
    try:
        train_losses(argv, world_size)
    except SimulatedCrash as crash:
        return str(crash)
    return None


@pytest.mark.long
def test_crash_during_save_then_exact_resume(gpt_data, tmp_path):
    """Saves at 5 and 10; every rank dies after iter_0000010's files are written, before `latest` names it.
    Resuming picks iter_0000005 and reproduces the uninterrupted run's losses 6..20 exactly."""
    straight = _straight(gpt_data)
    assert len(straight) == 20
    save = str(tmp_path / "ckpt")
    io = ["--save", save, "--load", save, "--save-interval", "5"]
    argv = small_argv(gpt_data, train_iters=20, extra=DROPOUT + io, **PIPE)
    assert run_distributed(_crash_on_second_commit, 4, argv, 4, timeout=240) == ["iter_0000010"] * 4
    assert os.path.isdir(os.path.join(save, "iter_0000010"))
    assert ck.read_latest(save) == "iter_0000005"
    resumed = run_distributed(train_losses, 4, argv, 4, timeout=240)[-1]
    assert resumed == straight[5:]
    assert ck.read_latest(save) == "iter_0000020"


def test_publish_latest_is_atomic(tmp_path, monkeypatch):
    ck.publish_latest(str(tmp_path), "iter_0000001")

    def broken_replace(src, dst):
        raise SimulatedCrash("killed before the rename")

    monkeypatch.setattr(ck.files.os, "replace", broken_replace)
    with pytest.raises(SimulatedCrash):
        ck.publish_latest(str(tmp_path), "iter_0000002")
    assert ck.read_latest(str(tmp_path)) == "iter_0000001"


def _load_with(argv, world_size):
    try:
        train_losses(argv, world_size)
    except ck.CheckpointMismatchError as err:
        return str(err)
    return None


def test_shape_mismatch_names_field(gpt_data, tmp_path):
    save = str(tmp_path / "ckpt")
    run_distributed(train_losses, 1, small_argv(gpt_data, train_iters=2, extra=["--save", save]), 1, timeout=120)
    bigger = small_argv(gpt_data, train_iters=4, extra=["--load", save])
    bigger[bigger.index("--hidden-size") + 1] = "64"
    message = run_distributed(_load_with, 1, bigger, 1, timeout=120)[0]
    assert message is not None and "hidden_size = 32" in message and "64" in message
