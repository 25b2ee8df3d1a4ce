"""Run a benchmark function on `world` local gloo ranks (spawned, one thread each); return rank 0's result."""
from __future__ import annotations

import datetime
import os
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
    """fn(*args) on every rank of a fresh gloo world of `world` processes; rank 0's return value."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    result = queue.get()
    for proc in procs:
        proc.join()
    return result
