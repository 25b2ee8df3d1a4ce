"""The one place that chooses the device and the communication backend.

CUDA + NCCL when DeepSpeed's accelerator is CUDA (a GPU is visible and ``DS_ACCELERATOR`` does not say otherwise),
CPU + gloo otherwise. Everything in ``tds`` and ``megatron`` asks this module instead of calling ``torch.cuda``,
so no CUDA-only call is reached on CPU. The device RNG is the CUDA generator on GPU and torch's default
(CPU) generator on CPU.
"""
from __future__ import annotations

import os
from functools import lru_cache

import torch


@lru_cache(maxsize=None)
def is_cuda() -> bool:
    """True when running on CUDA devices (DeepSpeed's accelerator decides, so both agree)."""
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().device_name() == "cuda"


def backend() -> str:
    """torch.distributed backend: 'nccl' on CUDA, 'gloo' on CPU."""
    return "nccl" if is_cuda() else "gloo"


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def device() -> torch.device:
    """The device of this process: cuda:LOCAL_RANK on GPU, cpu otherwise."""
    return torch.device("cuda", local_rank()) if is_cuda() else torch.device("cpu")


def set_device() -> None:
    """Bind this process to its GPU (no-op on CPU)."""
    if is_cuda():
        torch.cuda.set_device(local_rank())


def synchronize() -> None:
    if is_cuda():
        torch.cuda.synchronize()


def get_rng_state() -> torch.Tensor:
    """State of the generator that dropout on `device()` draws from."""
    return torch.cuda.get_rng_state() if is_cuda() else torch.get_rng_state()


def set_rng_state(state: torch.Tensor) -> None:
    if is_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def manual_seed(seed: int) -> None:
    """Seed the device generator only (on CPU this is torch's default generator)."""
    if is_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.default_generator.manual_seed(seed)  # torch.manual_seed also walks every device: slower


def max_memory_allocated() -> int:
    """Peak bytes allocated on the device; on CPU the process's peak resident set size."""
    if is_cuda():
        return torch.cuda.max_memory_allocated()
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def init_distributed(*args, timeout_s: float | None = None, **kwargs) -> None:
    """`deepspeed.init_distributed(*args, **kwargs)` made safe; this is also `tds.init_distributed`.

    - torch.distributed is initialised from the launcher's environment (deepspeed, torchrun: RANK, WORLD_SIZE,
      LOCAL_RANK, MASTER_ADDR, MASTER_PORT); a plain `python script.py` runs as a world of one; a process group
      created earlier (e.g. by a test harness) is adopted.
    - The backend defaults to this module's choice (NCCL on CUDA, gloo on CPU) and MPI discovery to off.
    - A torchrun restart (--max-restarts) meets in keys of its own (`restarted_attempt_store`).
    - On CPU, DeepSpeed would JIT-compile a shared-memory all-reduce op that only its inference path uses; a
      rank killed during that compile leaves a lock file that hangs every later start, so it is not built
      (set TDS_BUILD_SHM_OP=1 to build it).
    `timeout_s` is a shorthand for `timeout=datetime.timedelta(seconds=timeout_s)` (the default process
    group's timeout; the pipeline engine sets its own groups' timeouts, see `tds.pipe.collectives`).
    """
    import datetime

    import deepspeed
    import torch.distributed as dist
    if not dist.is_initialized():
        for key, value in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"),
                           ("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500")):
            os.environ.setdefault(key, value)
        set_device()
    if not is_cuda() and os.environ.get("TDS_BUILD_SHM_OP") != "1":
        import sys

        import deepspeed.comm.torch  # noqa: F401 - deepspeed.comm re-exports `torch`: use sys.modules
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    if not args:
        kwargs.setdefault("dist_backend", backend())
        kwargs.setdefault("auto_mpi_discovery", False)
    if timeout_s is not None:
        kwargs["timeout"] = datetime.timedelta(seconds=timeout_s)
    store = restarted_attempt_store(kwargs.get("timeout", datetime.timedelta(minutes=30)))
    if store is not None and not dist.is_initialized():
        dist.init_process_group(kwargs.get("dist_backend", backend()), store=store, timeout=kwargs.get("timeout"),
                                rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    deepspeed.init_distributed(*args, **kwargs)


def restarted_attempt_store(timeout):
    """Under torchrun, from its first restart on (TORCHELASTIC_RESTART_COUNT > 0): a client of the agent's
    store whose keys carry the attempt's number, or None.

    torchrun's workers meet in the store its agent keeps for the whole job (TORCHELASTIC_USE_AGENT_STORE); the
    default process group's keys there (each rank's gloo address) are the same in every attempt, so the ranks
    of a restarted attempt would read the addresses of the processes that died and fail with "Connection
    refused". The prefix gives each attempt keys of its own."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    import torch.distributed as dist
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"tds/attempt_{attempt}/", store)
