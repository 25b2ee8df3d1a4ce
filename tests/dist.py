"""Run a test function on N ranks (CPU, gloo) and bring every rank's result or traceback back to pytest.

    results = run_distributed(fn, world_size, *args, timeout=120)

`fn` must be a module-level function (it is pickled by reference). Each rank runs with RANK, WORLD_SIZE,
LOCAL_RANK, MASTER_ADDR and MASTER_PORT set, one intra-op thread, and torch.distributed initialised with
gloo on a free port. Returns the per-rank return values in rank order. If a rank raises, the first error is
re-raised with every failing rank's traceback; if ranks are still running after `timeout` seconds, they are
killed and the error names them. Processes come from a forkserver that has torch and deepspeed preloaded,
so starting 8 ranks costs well under a second each.
"""
from __future__ import annotations

import datetime
import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import socket
import time
import traceback
from typing import Any, Callable

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

_CTX = None
GRACE_AFTER_ERROR_S = 10.0


class DistributedTestError(AssertionError):
    pass


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "deepspeed", "numpy"])
    return _CTX


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, kwargs: dict,
            results, timeout: float) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=timeout))
        out = fn(*args, **kwargs)
        results.put((rank, "ok", pickle.dumps(out)))
        # Rank 0 hosts the TCP store: nobody leaves while a peer may still need it (e.g. in new_group).
        dist.barrier()
    except BaseException:  # noqa: BLE001 - everything goes back to pytest
        results.put((rank, "error", traceback.format_exc()))
    finally:
        results.close()
        results.join_thread()
    os._exit(0)  # skip atexit hooks that could block on peers which failed


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 120.0, **kwargs: Any) -> list:
    """Run `fn(*args, **kwargs)` on `world_size` gloo ranks; return the per-rank results in rank order."""
    ctx = _context()
    port = free_port()
    results = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, kwargs, results, timeout),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
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
                errors[rank] = payload
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
        raise DistributedTestError(f"{len(errors)} of {world_size} ranks failed{extra}:\n{report}")
    stuck = [r for r in range(world_size) if r not in outputs]
    if stuck:
        raise DistributedTestError(f"ranks {stuck} of {world_size} did not finish within {timeout:.0f}s "
                                   f"(stuck or deadlocked); finished: {sorted(outputs)}")
    return [outputs[r] for r in range(world_size)]
