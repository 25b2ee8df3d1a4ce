"""Running examples/ds_pretrain_gpt2.sh as a user does, with faults: a small layout, every loss logged, a plan of
injected faults (harness/faults/plan.py), and actions taken when a line of the log appears (a signal to the whole
process group, to one rank, to the script).

    run_script(env, when={r"^iteration 5/": action}, ...) -> Run(rc, log, losses)
    Run.losses: {iteration: loss}, exact (the log line prints 6 decimals; the ranks record each logged loss in
    full in MEGATRON_LOSS_RECORD's file, an iteration logged twice must record the same loss)
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from harness import ROOT
from megatron.logging_utils import LOSS_RECORD, recorded_losses

INJECT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "inject")  # a sitecustomize for PYTHONPATH
ITERS = 16
# (tp, pp, dp) = (1, 2, 2) on 4 processes, a tiny GPT-2; a checkpoint every 4 iterations, evaluation too
LAYOUT = dict(NPROC="4", TP="1", PP="2", NUM_LAYERS="2", HIDDEN="32", HEADS="4", SEQ_LEN="32", MICRO_BATCH="2",
              GAS="2", TRAIN_ITERS=str(ITERS), LOG_INTERVAL="1", EVAL_INTERVAL="4", EVAL_ITERS="1",
              SAVE_INTERVAL="4", SAMPLES="0", NGPUS="0")


@dataclass
class Run:
    rc: int
    log: str
    losses: Dict[int, float]


def script_env(data: dict, work_dir: str, faults: Optional[dict] = None, **extra: str) -> Dict[str, str]:
    """The example script's environment: the layout above, the test corpus, WORK_DIR (checkpoints in
    WORK_DIR/checkpoints), the venv's python first on PATH, and a fault plan when given."""
    path = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")
    env = dict(os.environ, PYTHON=sys.executable, PATH=path, WORK_DIR=str(work_dir), DATA_PATH=data["data_prefix"],
               VOCAB_FILE=data["vocab"], MERGE_FILE=data["merges"], PYTHONPATH=ROOT, **LAYOUT)
    for name in ("MEGATRON_ERROR_FILE", "MEGATRON_STOP_FILE", "FAULTS"):
        env.pop(name, None)
    if faults is not None:
        env.update(FAULTS=json.dumps(faults), PYTHONPATH=INJECT + os.pathsep + ROOT)
    env.update(extra)
    return env


def zero0_ds_config(folder) -> str:
    """The example's DeepSpeed config with ZeRO stage 0, written into `folder` as a user edits it; its path (for
    DS_CONFIG, with --zero-stage 0 on the command line: the JSON's stage must agree)."""
    with open(os.path.join(ROOT, "examples", "ds_config_gpt2.json")) as f:
        config = json.load(f)
    config["zero_optimization"]["stage"] = 0
    path = os.path.join(str(folder), "ds_config_zero0.json")
    with open(path, "w") as f:
        json.dump(config, f)
    return path


def run_script(env: Dict[str, str], when: Optional[Dict[str, Callable[[subprocess.Popen], None]]] = None,
               args: List[str] = (), timeout: float = 400, script: str = "ds_pretrain_gpt2.sh") -> Run:
    """Run the script in a session of its own (its process group is the job); each pattern of `when` fires its
    action once, on the first log line it matches."""
    fd, record = tempfile.mkstemp(prefix="losses_", suffix=".txt")
    os.close(fd)
    proc = subprocess.Popen(["bash", f"examples/{script}", *args], cwd=ROOT, env=dict(env, **{LOSS_RECORD: record}),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    pending, lines = dict(when or {}), []
    deadline = time.monotonic() + timeout
    try:
        for line in proc.stdout:
            lines.append(line)
            for pattern in list(pending):
                if re.search(pattern, line):
                    pending.pop(pattern)(proc)
            if time.monotonic() > deadline:
                raise AssertionError(f"the script ran over {timeout} s:\n{''.join(lines)[-4000:]}")
        return Run(proc.wait(timeout=60), "".join(lines), recorded_losses(record))
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        os.remove(record)


def to_group(sig: int) -> Callable[[subprocess.Popen], None]:
    """The action: `sig` to every process of the job at once (the script, its log filters, the launcher, the
    ranks): what SLURM's time limit, `scancel`, systemd's stop or `kill -- -PGID` do."""
    return lambda proc: os.killpg(proc.pid, sig)


def ranks_of(proc: subprocess.Popen) -> List[int]:
    """The pids of the training ranks under the script (LOCAL_RANK in their environment), by global rank."""
    import psutil
    found = {}
    for child in psutil.Process(proc.pid).children(recursive=True):
        try:
            env = child.environ()
        except psutil.Error:
            continue
        if "LOCAL_RANK" in env and "RANK" in env:
            found.setdefault(int(env["RANK"]), child.pid)
    return [found[r] for r in sorted(found)]


def to_rank(sig: int, rank: int) -> Callable[[subprocess.Popen], None]:
    """The action: `sig` to global rank `rank` only (one node preempted, one process signalled)."""
    def act(proc: subprocess.Popen) -> None:
        pids = ranks_of(proc)
        assert len(pids) > rank, pids
        os.kill(pids[rank], sig)
    return act


def logged_in_order(log: str, iters: int = ITERS) -> List[int]:
    return [int(i) for i in re.findall(rf"^ *iteration (\d+)/{iters} \|", log, re.M)]


def stopped_at(log: str, name: str) -> int:
    """The iteration of the one `exiting at iteration N of M: received SIGNAME` line."""
    found = re.findall(rf"^exiting at iteration (\d+) of \d+: received {name} ", log, re.M)
    assert len(found) == 1, log[-4000:]
    return int(found[0])


def reports(directory: str) -> List[dict]:
    """The per-rank reports of the fault plan's "report" folder, by rank."""
    out = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name)) as f:
            out.append(json.load(f))
    return sorted(out, key=lambda r: r["rank"])
