"""A user's mistake gets one line: `error: <message>` exactly once, exit status 2, no traceback, at most 3
lines of output after the launch line.

- 14 distinct mistakes through examples/ds_pretrain_gpt2.sh (the check before the launch, one process):
  nothing is launched; the check's own CPU time stays far under the 5-second promise, and it imports
  neither torch nor DeepSpeed.
- Mistakes through examples/ds_pretrain_t5.sh with CHECK_ARGS=0, i.e. inside pretrain_t5.py under torchrun
  with 2 processes: one after distributed start-up (a truncated .idx); under @pytest.mark.slow 9 more
  (argument parsing, the input-file check, a tokenizer file that does not load, T5 and schedule flags).
- A mistake that only one rank sees, while the other waits in a collective: printed once, both exit 2.
"""
from __future__ import annotations

import glob
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

import pytest

from harness.dist import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHECK_CPU_SECONDS = 2.5  # half of the 5 s promise; CPU time does not grow with other processes' load


def _env(tmp_path, **extra) -> dict:
    env = dict(os.environ, PYTHON=sys.executable, NGPUS="0", WORK_DIR=str(tmp_path / "work"),
               PATH=os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))
    env.pop("MEGATRON_ERROR_FILE", None)
    env.update(extra)
    return env


def _run_script(script: str, env: dict, args=(), timeout: int = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", f"examples/{script}", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _assert_one_line(proc: subprocess.CompletedProcess, needle: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, f"exit {proc.returncode}:\n{out[-3000:]}"
    errors = [line for line in out.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and needle in errors[0], out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    lines = out.strip().splitlines()
    launch = [i for i, line in enumerate(lines) if line.startswith("launching: ")]
    after = lines[launch[0] + 1:] if launch else lines
    assert len(after) <= 4, out  # start-up lines (where the ranks came from), the layout line, the error


@pytest.fixture(scope="module")
def bad_files(tmp_path_factory, gpt_data) -> dict:
    """A truncated .idx, an unreadable merges file, malformed and conflicting DeepSpeed configs."""
    d = tmp_path_factory.mktemp("bad")
    prefix = str(d / "truncated")
    shutil.copy(gpt_data["data_prefix"] + ".bin", prefix + ".bin")
    with open(gpt_data["data_prefix"] + ".idx", "rb") as f:
        (d / "truncated.idx").write_bytes(f.read()[:-20])
    (d / "merges.txt").write_text("#version: 0.2\nnot-a-merge-line-with-one-symbol\n")
    (d / "broken.json").write_text('{"train_micro_batch_size_per_gpu": 4,')
    (d / "conflict.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 3}))
    return dict(truncated=prefix, merges=str(d / "merges.txt"), broken=str(d / "broken.json"),
                conflict=str(d / "conflict.json"))


GPT_MISTAKES = [  # (environment, extra arguments, words of the message)
    (dict(HEADS="3", HIDDEN="63"), [], "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"),
    (dict(TP="3"), [], "world size 8 is not divisible"),
    (dict(DATA_PATH="{tmp}/missing_text_document"), [], "missing_text_document.idx not found"),
    (dict(DATA_PATH="{truncated}"), [], "truncated.idx: corrupt index"),
    (dict(VOCAB_FILE="{tmp}/nope.json"), [], "--vocab-file {tmp}/nope.json: file not found"),
    (dict(), ["--no-such-flag", "1"], "unrecognized arguments: --no-such-flag 1"),
    (dict(PRECISION="--fp16"), ["--bf16"], "--fp16 and --bf16 are both set"),
    (dict(DS_CONFIG="{broken}"), [], "not valid JSON"),
    (dict(DS_CONFIG="{conflict}"), [], "--micro-batch-size 4 conflicts with train_micro_batch_size_per_gpu = 3"),
    (dict(), ["--train-samples", "1000"], "--train-iters 10 cannot be combined with --train-samples"),
    (dict(), ["--partition-method", "0,3,99"], "boundaries must rise from 0 to 7"),
    (dict(DATA_PATH="0.5 {data} 0.5"), [], "WEIGHT PREFIX pairs, got 3 values"),
    (dict(DATA_PATH="0.7 {data} 0.3 {tmp}/books_text_document"), [], "--data-path {tmp}/books_text_document:"),
    (dict(), ["--rampup-batch-size", "8", "8", "100"], "--rampup-batch-size 8 8 100 cannot be combined"),
]


def test_mistakes_through_the_gpt2_script(tmp_path, gpt_data, bad_files):
    fill = dict(tmp=str(tmp_path), data=gpt_data["data_prefix"], **bad_files)
    base = dict(DATA_PATH=gpt_data["data_prefix"], VOCAB_FILE=gpt_data["vocab"], MERGE_FILE=gpt_data["merges"],
                TRAIN_ITERS="10")
    for env, args, needle in GPT_MISTAKES:
        env = {k: v.format(**fill) for k, v in {**base, **env}.items()}
        proc = _run_script("ds_pretrain_gpt2.sh", _env(tmp_path, **env), args)
        _assert_one_line(proc, needle.format(**fill))
        assert "launching:" not in proc.stdout  # nothing was started
    assert not (tmp_path / "work").exists() or not (tmp_path / "work" / "checkpoints").exists()


def test_check_step_is_fast_and_light(gpt_data):
    """The pre-launch check imports neither torch nor DeepSpeed; its CPU time (not inflated by the load of
    other processes on a shared machine) is far under the 5-second promise."""
    argv = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "3", "--seq-length", "16",
            "--micro-batch-size", "1", "--train-iters", "1", "--tensor-model-parallel-size", "2",
            "--data-path", gpt_data["data_prefix"], "--vocab-file", gpt_data["vocab"], "--merge-file",
            gpt_data["merges"]]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "megatron.config.preflight", "gpt", "--world-size", "8", *argv],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    assert proc.returncode == 2 and proc.stderr.startswith("error: --num-attention-heads 3"), proc.stderr
    assert cpu < CHECK_CPU_SECONDS, f"the check used {cpu:.2f} s of CPU ({wall:.2f} s wall)"
    probe = ("import sys, megatron.config.preflight; "
             "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'deepspeed'}))")
    imported = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert imported.stdout.strip() == "[]", imported.stdout + imported.stderr


def _t5_env(tmp_path, gpt_data, **extra) -> dict:
    """ds_pretrain_t5.sh without the pre-launch check, 2 processes (tp=2), on the BPE test corpus."""
    base = dict(CHECK_ARGS="0", NPROC="2", TP="2", PP="1", TRAIN_ITERS="2", DATA_PATH=gpt_data["data_prefix"],
                VOCAB_EXTRA_IDS="8", NUM_LAYERS="1", HIDDEN="16", HEADS="2", FFN="32", ENC_LEN="32", DEC_LEN="16")
    return _env(tmp_path, **{**base, **extra})


def _t5_bpe_args(gpt_data, merges=None) -> list:
    return ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", gpt_data["vocab"], "--merge-file",
            merges or gpt_data["merges"]]


T5_MISTAKES = [  # (environment, extra arguments (after the tokenizer ones), words), seen inside pretrain_t5.py
    (dict(DATA_PATH="{truncated}"), [], "truncated.idx: corrupt index"),  # after distributed start-up
]
T5_SLOW_MISTAKES = [
    (dict(HEADS="3"), [], "--num-attention-heads 3 is not divisible by --tensor-model-parallel-size 2"),
    (dict(DATA_PATH="{tmp}/missing_text_document"), [], "missing_text_document.idx not found"),
    (dict(), ["--merge-file", "{merges}"], "cannot build the GPT2BPETokenizer"),
    (dict(DS_CONFIG="{conflict}"), [], "--micro-batch-size 4 conflicts with train_micro_batch_size_per_gpu = 3"),
    (dict(), ["--partition-method", "type:Nothing"], "matches none of the layer classes"),
]


def _run_t5_mistakes(tmp_path, gpt_data, bad_files, mistakes) -> None:
    fill = dict(tmp=str(tmp_path), **bad_files)
    for env, args, needle in mistakes:
        env = {k: v.format(**fill) for k, v in env.items()}
        args = _t5_bpe_args(gpt_data) + [a.format(**fill) for a in args]
        proc = _run_script("ds_pretrain_t5.sh", _t5_env(tmp_path, gpt_data, **env), args, timeout=300)
        _assert_one_line(proc, needle)
        assert "launching:" in proc.stdout  # the mistake was found by pretrain_t5.py under torchrun


def test_mistake_inside_pretrain_t5_under_torchrun(tmp_path, gpt_data, bad_files):
    _run_t5_mistakes(tmp_path, gpt_data, bad_files, T5_MISTAKES)


@pytest.mark.slow
def test_more_mistakes_inside_pretrain_t5_under_torchrun(tmp_path, gpt_data, bad_files):
    _run_t5_mistakes(tmp_path, gpt_data, bad_files, T5_SLOW_MISTAKES)


RANK_SCRIPT = """
import os, sys, datetime
import torch, torch.distributed as dist
from megatron.errors import UserError, exit_on_user_error

def main():
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    if dist.get_rank() == 1:
        raise UserError("only rank 1 sees this mistake")
    dist.broadcast(torch.zeros(1), src=1)  # rank 0 waits for rank 1, which has left

exit_on_user_error(main)
"""


def test_mistake_seen_by_one_rank_is_printed_once_and_stops_both(tmp_path, error_file=False):
    """Rank 1 raises a UserError while rank 0 waits in a broadcast from it: one `error:` line (by rank 1; with
    MEGATRON_ERROR_FILE, as the example scripts set, in that file), both ranks exit 2, and rank 0's gloo error
    is no traceback (nor an abort at exit)."""
    script = tmp_path / "ranks.py"
    script.write_text(RANK_SCRIPT)
    port = str(free_port())
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port, PYTHONPATH=ROOT)
    env.pop("MEGATRON_ERROR_FILE", None)
    if error_file:
        env["MEGATRON_ERROR_FILE"] = str(tmp_path / "error")
    procs = [subprocess.Popen([sys.executable, str(script)], env=dict(env, RANK=str(r)), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    for marker in glob.glob(os.path.join(tempfile.gettempdir(), f"megatron-error-{os.getpid()}-*-{port}")):
        os.remove(marker)  # the launch's marker (the ranks' parent is this process)
    assert [p.returncode for p in procs] == [2, 2], outputs
    printed = "".join(outputs)
    assert "Traceback" not in printed, printed
    if error_file:
        assert printed == "" and (tmp_path / "error").read_text() == "only rank 1 sees this mistake\n"
    else:
        assert printed.splitlines() == ["error: only rank 1 sees this mistake"], printed


def test_data_path_takes_megatrons_blend():
    """DATA_PATH is one prefix (spaces allowed) or Megatron's WEIGHT PREFIX ... blend."""
    probe = 'source examples/common.sh; data_path_args; printf "%s|" "${DATA_PATH_ARGS[@]}"'
    cases = {"0.7 data/web_text_document 0.3 data/books_text_document":
             "0.7|data/web_text_document|0.3|data/books_text_document|",
             "my data/web_text_document": "my data/web_text_document|", "data/x": "data/x|", "1e-1 a 2 b": "1e-1|a|2|b|"}
    for value, want in cases.items():
        proc = subprocess.run(["bash", "-c", probe], cwd=ROOT, env=dict(os.environ, DATA_PATH=value),
                              capture_output=True, text=True, timeout=30)
        assert proc.stdout == want, (value, proc.stdout, proc.stderr)
