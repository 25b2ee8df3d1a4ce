"""Run a benchmark function on `world` local gloo ranks (spawned, one thread each); return rank 0's result."""
from __future__ import annotations

import datetime
import os
import queue
import socket

import torch
import torch.multiprocessing as mp


def _worker(rank: int, world: int, port: int, fn, args: tuple, queue) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    import torch.distributed as dist
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
    from tds import device
    device.init_distributed()
    result = fn(*args)
    if rank == 0:
        queue.put(result)


def run_on_ranks(fn, world: int, *args):
    """fn(*args) on every rank of a fresh gloo world of `world` processes; rank 0's return value. A rank that
    exits with an error ends the run: the others are terminated and RuntimeError names the rank and its exit code
    (its traceback is on stderr)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    result_queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, result_queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    try:
        result = _rank0_result(procs, result_queue)
        for proc in procs:
            proc.join()
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
                proc.join()
    return result


def _rank0_result(procs: list, result_queue) -> object:
    """Rank 0's result once it is put, or RuntimeError as soon as a rank has exited with an error."""
    while True:
        try:
            return result_queue.get(timeout=1.0)
        except queue.Empty:
            failed = [(rank, proc.exitcode) for rank, proc in enumerate(procs) if proc.exitcode not in (None, 0)]
            if failed:
                listed = ", ".join(f"rank {rank} (exit code {code})" for rank, code in failed)
                raise RuntimeError(f"benchmark worker failed: {listed}; see its traceback above") from None
