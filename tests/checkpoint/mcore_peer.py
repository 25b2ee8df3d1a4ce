"""Megatron core as a test peer (the harness; the peer itself is mcore_peer_script.py).

The megatron-core wheel installs a `megatron/` namespace that would shadow this project's `megatron` package, so it
never goes into .venv: `installed(version)` puts each release into a folder of its own under .peers/ (pip install
--no-deps --target; kept between runs, as .venv is), and the peer runs in a subprocess whose PYTHONPATH is that
folder.

    VERSIONS                 every release from 0.15 on that installs on this Python (0.15.x: MCoreMetadata in the
                             index; 0.16.x: torch's Metadata carrying every rank's SavePlan)
    Peer(version)            one peer process for the whole test: .save(kind, dir) -> core's logits of the model
                             it wrote; .load(dir) -> logits of core's GPTModel loaded from dir
    save_tp(version, tp, kind, dir) -> logits   one checkpoint written by tp gloo processes of Megatron core
"""
from __future__ import annotations

import fcntl
import json
import os
import queue
import shutil
import socket
import subprocess
import sys
import threading
from typing import Optional

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mcore_peer_script.py")
PEERS = os.path.join(ROOT, ".peers")
VERSIONS = ("0.15.3", "0.16.1")
REPLY_TIMEOUT_S = 300


def installed(version: str) -> str:
    """The folder holding megatron-core `version` (installed once; a lock keeps concurrent runs apart)."""
    folder = os.path.join(PEERS, f"megatron-core-{version}")
    os.makedirs(PEERS, exist_ok=True)
    with open(os.path.join(PEERS, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isdir(os.path.join(folder, "megatron", "core")):
            partial = folder + ".partial"
            shutil.rmtree(partial, ignore_errors=True)
            proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", partial,
                                   f"megatron-core=={version}"], capture_output=True, text=True)
            if proc.returncode != 0:
                raise RuntimeError(f"pip could not install megatron-core=={version} into {partial}: "
                                   f"{proc.stderr.strip()[-2000:]}")
            os.rename(partial, folder)
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(version: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                           "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=installed(version), OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    return env


def ids_file(folder: str) -> str:
    """Token ids (2, 16) below the peer models' vocabulary, seeded, saved where the peer reads them."""
    from tests.checkpoint.mcore_peer_script import SEQ, VOCAB
    path = os.path.join(folder, "ids.pt")
    if not os.path.isfile(path):
        torch.save(torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0)), path)
    return path


class Peer:
    """One megatron-core process serving save / load requests (see mcore_peer_script.py)."""

    def __init__(self, version: str, work: str):
        self.version, self.work, self.count = version, work, 0
        self.proc = subprocess.Popen([sys.executable, SCRIPT, "--port", str(_free_port())], cwd=work,
                                     env=_env(version), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self.stderr: list = []
        threading.Thread(target=self._pump, args=(self.proc.stdout, self.lines), daemon=True).start()
        threading.Thread(target=self._pump, args=(self.proc.stderr, None), daemon=True).start()
        ready = self._reply()
        assert ready.get("ready") and ready.get("version") == version, ready

    def _pump(self, stream, into) -> None:
        for line in stream:
            (into.put(line) if into is not None else self.stderr.append(line))
        if into is not None:
            into.put(None)

    def _reply(self) -> dict:
        while True:  # core prints a deprecation line or two on stdout; replies are the JSON lines
            try:
                line = self.lines.get(timeout=REPLY_TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(f"megatron-core {self.version}: no reply in {REPLY_TIMEOUT_S} s") from None
            if line is None:
                raise AssertionError(f"megatron-core {self.version} exited ({self.proc.wait()}):\n"
                                     + "".join(self.stderr)[-4000:])
            if line.startswith("{"):
                return json.loads(line)

    def _request(self, **request) -> torch.Tensor:
        self.count += 1
        out = os.path.join(self.work, f"logits_{self.count}.pt")
        self.proc.stdin.write(json.dumps(dict(request, ids=ids_file(self.work), logits=out)) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        assert reply.get("ok"), f"megatron-core {self.version}: {reply.get('traceback') or reply}"
        return torch.load(out, weights_only=True)

    def save(self, kind: str, folder: str) -> torch.Tensor:
        """Core's own `kind` model written to `folder` with dist_checkpointing.save; its logits (b, s, v)."""
        return self._request(op="save", kind=kind, dir=folder)

    def load(self, folder: str) -> torch.Tensor:
        """Logits of core's GPTModel built from `folder`'s arguments and loaded by dist_checkpointing.load."""
        return self._request(op="load", dir=folder)

    def __enter__(self) -> "Peer":
        return self

    def __exit__(self, *exc) -> None:
        self.proc.stdin.close()  # the peer's loop ends
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def save_tp(version: str, tp: int, kind: str, folder: str, work: str) -> torch.Tensor:
    """`kind` written by `tp` gloo processes of megatron-core (tensor parallelism); core's gathered logits."""
    out = os.path.join(work, f"logits_tp{tp}.pt")
    proc = subprocess.run([sys.executable, SCRIPT, "--tp", str(tp), "--port", str(_free_port()), "save", kind, folder,
                           ids_file(work), out], cwd=work, env=_env(version), capture_output=True, text=True,
                          timeout=REPLY_TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=True)
