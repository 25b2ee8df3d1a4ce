"""Run a test function on N ranks (CPU, gloo) and bring every rank's result or traceback back to pytest.

    results = run_distributed(fn, world_size, *args, timeout=120)

`fn` must be a module-level function (it is pickled by reference). Each rank runs with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, one intra-op thread, and torch.distributed initialised with
gloo on a free port. Returns the per-rank return values in rank order. If a rank raises, the first error is
re-raised with every failing rank's traceback; if ranks are still running after `timeout` seconds, they are
killed and the error names them. Processes come from a forkserver that has torch, dynamo (which
torch.optim imports on first use), deepspeed and megatron's training loop preloaded: each rank starts with no
imports to do, about 5 s of CPU saved per rank (tests/model/test_layouts.py with test_llama_pretrain.py: 103 s
-> 67 s).

The error says what happened by its class, so a test can expect one outcome and no other (e.g.
`pytest.mark.xfail(raises=rank_raised("AssertionError"))`):
    RankCrashed         a rank died without reporting (e.g. a C++ abort in gloo: exit code -6); its peers'
                        errors (connection reset) are consequences
    rank_raised(name)   otherwise, the first rank to report an error raised an exception of class `name`
                        ('AssertionError'; builtins by bare name, others module-qualified)
    RankTimeout         no rank failed, but some did not finish within `timeout` (a hang)
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import sys
import time
import traceback
from typing import Any, Callable, Dict, Optional

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

_CTX = None
GRACE_AFTER_ERROR_S = 10.0


class DistributedTestError(AssertionError):
    """Ranks failed or hung; `rank_errors` maps each rank that raised to its exception's class name."""

    def __init__(self, message: str, rank_errors: Optional[Dict[int, str]] = None):
        super().__init__(message)
        self.rank_errors = dict(rank_errors or {})


class RankTimeout(DistributedTestError):
    """No rank raised, but some were still running at the timeout and were killed."""


class RankCrashed(DistributedTestError):
    """A rank exited without reporting (killed by a signal, a C++ abort)."""


class RankRaised(DistributedTestError):
    """A rank raised; the subclass `rank_raised(name)` names the class of the first rank's exception."""


_RANK_RAISED: Dict[str, type] = {}


def rank_raised(name: str) -> type:
    """The error class run_distributed raises when the first rank to fail raised an exception of class
    `name` (builtins by bare name, e.g. 'AssertionError'; others module-qualified)."""
    if name not in _RANK_RAISED:
        _RANK_RAISED[name] = type(f"RankRaised[{name}]", (RankRaised,), {"__module__": __name__})
    return _RANK_RAISED[name]


def exception_name(exc: BaseException) -> str:
    cls = type(exc)
    return cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo", "deepspeed", "numpy",
                                    "megatron.training.pretrain"])
    return _CTX


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _flush() -> None:
    sys.stdout.flush()
    sys.stderr.flush()


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict,
            results, timeout: float) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    reported = False
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        out = fn(*args, **kwargs)
        _flush()  # what the rank printed reaches the captured file before the parent reads it
        results.put((rank, "ok", pickle.dumps(out)))
        reported = True
        # Rank 0 hosts the TCP store: nobody leaves while a peer may still need it (e.g. in new_group).
        dist.barrier()
    except BaseException as exc:  # noqa: BLE001 - everything goes back to pytest
        if not reported:  # after its result, a rank fails only in the barrier: a peer's failure, not its own
            _flush()
            results.put((rank, "error", (exception_name(exc), traceback.format_exc())))
    finally:
        results.close()
        results.join_thread()
    os._exit(0)  # skip atexit hooks that could block on peers which failed


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the per-rank results in rank order.
    A free port can be taken by another process between free_port() and rank 0's listen (two pytest workers):
    a launch whose store could not listen (EADDRINUSE, before `fn` ran) is started again on another port."""
    for _ in range(2):
        try:
            return _launch(fn, world_size, args, kwargs, timeout)
        except RankRaised as err:
            if "EADDRINUSE" not in str(err):
                raise
    return _launch(fn, world_size, args, kwargs, timeout)


def _launch(fn: Callable, world_size: int, args: tuple, kwargs: dict, timeout: float) -> list:
    ctx = _context()
    port = free_port()
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, kwargs, results, timeout),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}  # rank -> traceback
    raised: dict[int, str] = {}  # rank -> exception class name, in the order the errors arrived
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(errors) < world_size:
            now = time.monotonic()
            if now > deadline:
                break
            try:
                rank, status, payload = results.get(timeout=min(0.5, deadline - now))
            except queue_mod.Empty:
                for r, p in enumerate(procs):
                    if p.exitcode is not None and r not in outputs and r not in errors:
                        time.sleep(0.5)  # its message may still be in flight
                        if r not in outputs and r not in errors and results.empty():
                            errors[r] = f"rank {r} exited with code {p.exitcode} without reporting"
                continue
            if status == "ok":
                outputs[rank] = pickle.loads(payload)
            else:
                raised[rank], errors[rank] = payload
                deadline = min(deadline, time.monotonic() + GRACE_AFTER_ERROR_S)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        results.close()
    if errors:
        report = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        stuck = [r for r in range(world_size) if r not in outputs and r not in errors]
        extra = f"; ranks {stuck} still running were killed" if stuck else ""
        message = f"{len(errors)} of {world_size} ranks failed{extra}:\n{report}"
        if len(raised) < len(errors):
            raise RankCrashed(message, raised)
        raise rank_raised(next(iter(raised.values())))(message, raised)
    stuck = [r for r in range(world_size) if r not in outputs]
    if stuck:
        raise RankTimeout(f"ranks {stuck} of {world_size} did not finish within {timeout:.0f}s "
                          f"(stuck or deadlocked); finished: {sorted(outputs)}")
    return [outputs[r] for r in range(world_size)]
