"""A damaged checkpoint is one line: the file, what it holds, the newest complete iteration and --ckpt-step N.

One run of examples/ds_pretrain_gpt2.sh at (tp, pp, dp) = (2, 1, 2) saves iterations 2 and 4 (each with its
manifest.json); every test damages a copy of that directory the way a user meets it (a copy cut short, a
deleted shard, a file overwritten in place, one flipped byte, a checkpoint saved before manifests) and goes on
through the example script, bare torchrun or tools/convert_checkpoint.py.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from megatron.checkpointing import read_latest
from harness.dist import free_port
from harness.example_data import own_copy
from tests.training.test_user_errors import _assert_one_line, _env, _run_script

pytestmark = pytest.mark.long

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LAYOUT = dict(NPROC="4", TP="2", PP="1", NUM_LAYERS="2", HIDDEN="32", HEADS="4", SEQ_LEN="32", MICRO_BATCH="2",
              GAS="1", EVAL_ITERS="0", LOG_INTERVAL="2", SAVE_INTERVAL="2", SAMPLES="0")
LAYER = "layer_02-model_01-model_states.pt"
SHARD = "zero_pp_rank_1_mp_rank_01_optim_states.pt"
OLDER = "the newest complete checkpoint in {ckpt} is iteration 2: load it with --ckpt-step 2"
VERIFIED = "the newest verified checkpoint in {ckpt} is iteration 2: load it with --ckpt-step 2"


def _script_env(tmp_path, data, ckpt: str, iters: int) -> dict:
    return _env(tmp_path, **LAYOUT, TRAIN_ITERS=str(iters), SAVE=ckpt, DATA_PATH=data["data_prefix"],
                VOCAB_FILE=data["vocab"], MERGE_FILE=data["merges"])


@pytest.fixture(scope="module")
def data(tmp_path_factory, gpt_data) -> dict:
    """The session's corpus in a folder of its own: the index maps cached beside it are named without the
    split, so another module's runs with another split must not share them."""
    return own_copy(gpt_data, tmp_path_factory.mktemp("damaged_data"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory, data) -> str:
    """A checkpoint directory with iterations 2 and 4 (latest), saved through the example script."""
    root = tmp_path_factory.mktemp("damaged")
    ckpt = str(root / "checkpoints")
    proc = _run_script("ds_pretrain_gpt2.sh", _script_env(root, data, ckpt, 4), timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    assert read_latest(ckpt) == "iter_0000004"
    return ckpt


def _copy(saved: str, tmp_path) -> str:
    ckpt = str(tmp_path / "checkpoints")
    shutil.copytree(saved, ckpt)
    return ckpt


def _truncate(path: str) -> None:
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)


def _resume_from_2(tmp_path, data, ckpt: str) -> None:
    """--ckpt-step 2 through the script loads iteration 2 and trains on to 6."""
    proc = _run_script("ds_pretrain_gpt2.sh", _script_env(tmp_path, data, ckpt, 6), ["--ckpt-step", "2"],
                       timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert f"loaded checkpoint {ckpt}/iter_0000002: iteration 2" in out and read_latest(ckpt) == "iter_0000006"


def test_truncated_layer_file_through_the_script(saved, data, tmp_path):
    ckpt = _copy(saved, tmp_path)
    _truncate(os.path.join(ckpt, "iter_0000004", LAYER))
    proc = _run_script("ds_pretrain_gpt2.sh", _script_env(tmp_path, data, ckpt, 6), timeout=300)
    _assert_one_line(proc, f"{ckpt}/iter_0000004/{LAYER} (weights of pipeline layer 2, tp rank 1) is truncated: ")
    assert OLDER.format(ckpt=ckpt) in proc.stderr
    _resume_from_2(tmp_path, data, ckpt)


def test_file_overwritten_in_place_through_the_script(saved, data, tmp_path):
    """Same size, unreadable content: the read fails on the bytes the manifest's CRC-32 does not match, and the
    failure names the file."""
    ckpt = _copy(saved, tmp_path)
    path = os.path.join(ckpt, "iter_0000004", "mp_rank_01_model_states.pt")
    with open(path, "r+b") as f:
        f.write(bytes(os.path.getsize(path)))
    proc = _run_script("ds_pretrain_gpt2.sh", _script_env(tmp_path, data, ckpt, 6), timeout=300)
    _assert_one_line(proc, "mp_rank_01_model_states.pt (engine state of pipeline stage 0, tp rank 1: LR scheduler, "
                           "steps, client state, RNG) is damaged: CRC-32 ")
    assert VERIFIED.format(ckpt=ckpt) in proc.stderr


def test_flipped_byte_in_a_weight_file_through_the_script(saved, data, tmp_path):
    """One byte of tensor data flipped (a bad disk or copy; same size, and torch reads it without an error): the
    relaunch refuses it by its CRC-32 (checked while the file is read), naming the file and the newest
    checkpoint that verifies, instead of training on it (that --ckpt-step 2 then resumes: the truncated file's
    test)."""
    ckpt = _copy(saved, tmp_path)
    path = os.path.join(ckpt, "iter_0000004", LAYER)
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x01]))
    proc = _run_script("ds_pretrain_gpt2.sh", _script_env(tmp_path, data, ckpt, 6), timeout=300)
    _assert_one_line(proc, f"{ckpt}/iter_0000004/{LAYER} (weights of pipeline layer 2, tp rank 1) is damaged: CRC-32 ")
    assert VERIFIED.format(ckpt=ckpt) in proc.stderr and "iteration 5/6" not in proc.stdout


def test_pickle_that_runs_a_command_through_the_script(saved, data, tmp_path):
    """An mp_rank file replaced by a pickle that would run `touch` (the manifest rewritten to match): DeepSpeed's
    read goes through the allowlist (tds/safe_load.py), the load stops with one line naming the file and the
    global, and the command never runs."""
    import torch
    from megatron.checkpointing.manifest import write_manifest
    from tests.checkpoint.test_safe_load import Command
    ckpt = _copy(saved, tmp_path)
    marker = tmp_path / "command_ran"
    torch.save({"payload": Command(str(marker))}, os.path.join(ckpt, "iter_0000004", "mp_rank_00_model_states.pt"))
    write_manifest(os.path.join(ckpt, "iter_0000004"))
    proc = _run_script("ds_pretrain_gpt2.sh", _script_env(tmp_path, data, ckpt, 6), timeout=300)
    _assert_one_line(proc, "iter_0000004/mp_rank_00_model_states.pt: refused, its pickle calls posix.system")
    assert not marker.exists()
    _run_script("ds_pretrain_gpt2.sh", _script_env(tmp_path, data, ckpt, 6), ["--trust-checkpoint"], timeout=300)
    assert marker.exists()  # the opt-in reads the file as a plain pickle (the load then fails on its content)


def test_missing_shard_under_bare_torchrun(saved, data, tmp_path):
    """The line appears once and the workers exit 2; torchrun itself always exits 1 when a worker fails
    (its ChildFailedError), and prints its own report of the failed workers after the line."""
    ckpt = _copy(saved, tmp_path)
    os.remove(os.path.join(ckpt, "iter_0000004", SHARD))
    args = ["--tensor-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads",
            "4", "--seq-length", "32", "--micro-batch-size", "2", "--gas", "1", "--train-iters", "6",
            "--data-path", data["data_prefix"], "--vocab-file", data["vocab"], "--merge-file",
            data["merges"], "--num-workers", "0", "--eval-iters", "0", "--save", ckpt, "--load", ckpt]
    env = _env(tmp_path, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port",
           str(free_port()), "pretrain_gpt2.py", *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, out[-3000:]
    assert f"{SHARD} (optimizer partition of dp rank 1, pipeline stage 0, tp rank 1) is missing (manifest.json " \
           f"lists it); " \
           f"{OLDER.format(ckpt=ckpt)}" in errors[0]
    assert proc.returncode == 1 and "exitcode  : 2" in out, out[-3000:]
    assert "[rank" not in out, out[-3000:]  # no worker printed a traceback


def test_ckpt_step_that_was_not_saved(saved, data, tmp_path):
    proc = _run_script("ds_pretrain_gpt2.sh", _script_env(tmp_path, data, saved, 6), ["--ckpt-step", "3"])
    _assert_one_line(proc, f"--ckpt-step 3: {saved}/iter_0000003 does not exist; the iterations saved in --load "
                           f"{saved} are: 2, 4")
    assert "launching:" not in proc.stdout


def test_checkpoint_saved_before_manifests(saved, data, tmp_path):
    """Without manifest.json (what the save wrote before this change; nothing else differs) a truncated file
    is found by its missing zip end record, and the line names the older iteration."""
    ckpt = _copy(saved, tmp_path)
    for tag in ("iter_0000002", "iter_0000004"):
        if os.path.exists(os.path.join(ckpt, tag, "manifest.json")):
            os.remove(os.path.join(ckpt, tag, "manifest.json"))
    _truncate(os.path.join(ckpt, "iter_0000004", LAYER))
    proc = _run_script("ds_pretrain_gpt2.sh", _script_env(tmp_path, data, ckpt, 6), timeout=300)
    _assert_one_line(proc, f"{LAYER} (weights of pipeline layer 2, tp rank 1) is truncated: ")
    assert "without the zip end record" in proc.stderr and OLDER.format(ckpt=ckpt) in proc.stderr


def _tool(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tools/convert_checkpoint.py", *argv], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def _assert_tool_line(proc: subprocess.CompletedProcess, needle: str) -> None:
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode == 2 and len(errors) == 1 and needle in errors[0], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr


def test_the_tools(saved, tmp_path):
    """inspect checks sizes, inspect --verify checksums; every tool stops on a damaged file with one line."""
    ckpt = _copy(saved, tmp_path)
    intact = _tool("inspect", ckpt, "--verify")
    assert intact.returncode == 0 and "verified         15 files" in intact.stdout, intact.stderr[-3000:]
    layer = os.path.join(ckpt, "iter_0000004", LAYER)
    with open(layer, "r+b") as f:  # one byte of tensor data changed: same size, loads without an error
        f.seek(os.path.getsize(layer) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))
    assert _tool("inspect", ckpt).returncode == 0
    _assert_tool_line(_tool("inspect", ckpt, "--verify"), f"{LAYER} (weights of pipeline layer 2, tp rank 1) is "
                                                          f"damaged: CRC-32 ")
    os.remove(os.path.join(ckpt, "iter_0000004", SHARD))
    for argv in (["inspect", ckpt], ["reshape", "--load", ckpt, "--save", str(tmp_path / "r"),
                                     "--tensor-model-parallel-size", "1", "--pipe-parallel-size", "1"]):
        _assert_tool_line(_tool(*argv), f"{SHARD} (optimizer partition of dp rank 1, pipeline stage 0, tp rank 1) "
                                        f"is missing (manifest.json lists it); {OLDER.format(ckpt=ckpt)} (the tools: "
                                        f"--tag iter_0000002)")
    assert _tool("inspect", ckpt, "--tag", "iter_0000002", "--verify").returncode == 0
