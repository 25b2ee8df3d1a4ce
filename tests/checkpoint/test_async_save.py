"""--async-save: the same files and losses as synchronous saves, a kill -9 during the background write, a
write that fails.

GPT-2 of the golden runs (`pretrain()` as pretrain_gpt2.py runs it) at (tp, pp, dp) = (1, 2, 2), 15 iterations,
saves every 5. The killed run: every rank dies by SIGKILL while iter_0000010 is being written in the
background (ranks 0-2 have written their files and markers, rank 3 half of its first file) and training
goes on. The second launch trains the uninterrupted synchronous run, then resumes the killed run's directory
asynchronously: from `latest` = iter_0000005 it must reproduce the synchronous losses 6..15 bit for bit while
its saves at 10 and 15 are written in the background, and every checkpoint file must equal the synchronous
run's byte for byte (megatron_args.json differs: it records --async-save and --save).
"""
import io
import os
import signal
import time

import pytest
import torch

import megatron.checkpointing as ck
from megatron.checkpointing import async_save
from megatron.checkpointing.manifest import read_manifest, verify_checksums
from tests.checkpoint.common import argv
from harness.dist import DistributedTestError, run_distributed
from tests.training.golden_cases import rank_run

ITERS, EVERY, KILLED_AT, VICTIM = 15, 5, "iter_0000010", 3
LAYOUT = dict(tp=1, pp=2)


def _args(data_prefix: str, save: str, extra=()) -> list:
    return argv("gpt2", data_prefix, iters=ITERS, extra=["--save", save, "--save-interval", str(EVERY), *extra],
                **LAYOUT)


def _killed_write(rendezvous: str, real):
    """`_write_files` that, for KILLED_AT, writes everything but on VICTIM (half of its first file), then
    waits until every rank got there and kills its process with SIGKILL."""
    def write_files(write, writes, folder, rank, *rest):
        if os.path.basename(folder) != KILLED_AT:
            return real(write, writes, folder, rank, *rest)
        if rank == VICTIM:
            path, state = writes[0]
            write(state, path)
            os.truncate(path, os.path.getsize(path) // 2)
        else:
            real(write, writes, folder, rank, *rest)
        open(os.path.join(rendezvous, str(rank)), "w").close()
        while len(os.listdir(rendezvous)) < 4:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGKILL)
    return write_files


def _train_killed(args, world, rendezvous):
    async_save._write_files = _killed_write(rendezvous, async_save._write_files)
    rank_run("gpt2", args, world)


def _sync_then_resume(sync_args, resume_args, world):
    return rank_run("gpt2", sync_args, world)[0], rank_run("gpt2", resume_args, world)[0]


def _pt_bytes(folder: str) -> dict:
    names = sorted(n for n in os.listdir(folder) if n.endswith(".pt"))
    return {n: open(os.path.join(folder, n), "rb").read() for n in names}


@pytest.mark.long
def test_kill_during_background_write_then_exact_resume(data_prefix, tmp_path):
    killed, sync = str(tmp_path / "async"), str(tmp_path / "sync")
    rendezvous = tmp_path / "killpoint"
    rendezvous.mkdir()
    with pytest.raises(DistributedTestError):
        run_distributed(_train_killed, 4, _args(data_prefix, killed, ["--async-save"]), 4, str(rendezvous),
                        timeout=300)
    assert ck.read_latest(killed) == "iter_0000005"
    left = os.listdir(os.path.join(killed, KILLED_AT))
    assert "manifest.json" not in left  # and the resume must not take the killed save's markers for its own:
    assert sorted(n for n in left if n.startswith(".done")) == [".done.0.json", ".done.1.json", ".done.2.json"]

    resume = _args(data_prefix, killed, ["--async-save", "--load", killed])
    straight, resumed = run_distributed(_sync_then_resume, 4, _args(data_prefix, sync), resume, 4, timeout=300)[-1]
    assert len(straight) == ITERS and resumed == straight[EVERY:]
    assert ck.read_latest(killed) == "iter_0000015"
    for tag in ("iter_0000005", KILLED_AT, "iter_0000015"):
        mine, theirs = os.path.join(killed, tag), os.path.join(sync, tag)
        assert _pt_bytes(mine) == _pt_bytes(theirs), tag
        assert sorted(os.listdir(mine)) == sorted(os.listdir(theirs)), tag  # no markers left
        listed, reference = read_manifest(mine), read_manifest(theirs)
        del listed[ck.ARGS_FILE], reference[ck.ARGS_FILE]
        assert listed == reference, tag
        verify_checksums(mine, ck.read_checkpoint_args(killed, tag))


def _failing_run(args, world):
    try:
        rank_run("gpt2", args, world)
    except async_save.AsyncSaveError as err:
        return str(err)
    return None


def test_failed_background_write_is_one_line_error_at_the_next_save(data_prefix, tmp_path):
    """The engine-state file of the save at 5 is a directory: the thread's torch.save fails; the error reaches
    the main thread at the save at 10, naming the file, and nothing is published."""
    save = str(tmp_path / "ckpt")
    blocked = os.path.join(save, "iter_0000005", "mp_rank_00_model_states.pt")
    os.makedirs(blocked)
    args = argv("gpt2", data_prefix, 1, 1, 10, ["--save", save, "--save-interval", str(EVERY), "--async-save"])
    [message] = run_distributed(_failing_run, 1, args, 1, timeout=300)
    assert message is not None and "\n" not in message
    assert message.startswith(f"asynchronous save of {blocked} failed (RuntimeError") and "Is a directory" in message
    assert ck.read_latest(save) is None


def test_snapshot_is_a_copy_torch_save_writes_identically():
    flat = torch.arange(12.0)
    state = {"views": [flat[:4], flat[4:]], "step": 3, "param": torch.nn.Parameter(torch.ones(2))}
    state["param"].partition_dim = 0
    state["again"] = state["views"]

    def saved(obj) -> bytes:
        buffer = io.BytesIO()
        torch.save(obj, buffer)
        return buffer.getvalue()
    copy = async_save.snapshot(state)
    assert saved(copy) == saved(state) and copy["again"] is copy["views"]
    flat.add_(1)
    assert copy["views"][0].tolist() == [0.0, 1.0, 2.0, 3.0]
