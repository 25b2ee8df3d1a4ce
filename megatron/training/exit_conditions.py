"""When a run stops early and saves: a scheduler's signal (--exit-signal-handler) or a time limit
(--exit-duration-in-mins), agreed by every rank once per iteration.

SLURM preempts or ends a job by sending SIGTERM (or the signal of `--signal=USR1@120`) and, after its grace
time, SIGKILL; a launcher may forward the same signal twice, and only some ranks may receive it. The handler
only records the first signal (later ones change nothing; SIGKILL stays the hard stop). Before each iteration
`ExitConditions.post()` starts one asynchronous all_reduce (MAX) of two integers over the world group: the signal
any rank has received so far, and whether any rank has run longer than the limit; after the iteration
`reason()` waits for it (long done by then: it ran beside the iteration) and reads the answer. Every rank sees
the same answer, so every rank saves the same iteration and exits 0; a signal that arrives during iteration N is
acted on after iteration N + 1. The time the loop spends blocked in both calls is measured by
bench/exit_check.py (docs/long-runs.md).

The handler is installed when the run starts, before any DataLoader worker is forked: a worker inherits it,
so a signal sent to every process of a job (scancel) only sets a flag there.

A run that ends cleanly (completed, or stopped and saved) has rank 0 write one line to MEGATRON_STOP_FILE when
the environment names one (`record_clean_end`): the example scripts set it, and when the whole job was
signalled and a launcher exited non-zero although its workers saved and exited 0 (DeepSpeed's launcher), the
file tells them so.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Optional

import torch
import torch.distributed as dist

from tds import device as tds_device

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
STOP_FILE_ENV = "MEGATRON_STOP_FILE"


def record_clean_end(line: str) -> None:
    """Rank 0, once the run's last checkpoint is written: `line` into MEGATRON_STOP_FILE, if it is set."""
    path = os.environ.get(STOP_FILE_ENV)
    if not path or (dist.is_initialized() and dist.get_rank() != 0):
        return
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(line + "\n")
    os.replace(tmp, path)


class ExitConditions:
    """The signal handler and the time limit of one run (`close()` restores the previous handlers)."""

    def __init__(self, signal_handler: bool, duration_mins: Optional[float], started: Optional[float] = None):
        self.started = time.monotonic() if started is None else started
        self.limit_s = None if duration_mins is None else 60.0 * duration_mins
        self.received: Optional[int] = None
        self._pending = None     # (flags, the all_reduce's work or None) between post() and reason()
        self.blocked_s = 0.0     # time spent in post() and reason(): what the agreement costs the loop
        self._previous = {}
        if signal_handler:
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._record)

    @classmethod
    def of(cls, exit_cfg, started: Optional[float] = None) -> "ExitConditions":
        """From the RunConfig's exit section."""
        return cls(exit_cfg.exit_signal_handler, exit_cfg.exit_duration_in_mins, started)

    def _record(self, signum: int, frame) -> None:
        if self.received is None:
            self.received = signum

    @property
    def active(self) -> bool:
        return bool(self._previous) or self.limit_s is not None

    def post(self) -> None:
        """Collective (when active): start agreeing on the conditions as they are now; `reason()` reads it."""
        if not self.active or self._pending is not None:
            return
        started = time.perf_counter()
        timed_out = self.limit_s is not None and time.monotonic() - self.started >= self.limit_s
        flags = torch.tensor([self.received or 0, int(timed_out)], dtype=torch.int64, device=tds_device.device())
        work = None
        if dist.is_initialized() and dist.get_world_size() > 1:
            work = dist.all_reduce(flags, op=dist.ReduceOp.MAX, async_op=True)
        self._pending = (flags, work)
        self.blocked_s += time.perf_counter() - started

    def reason(self) -> Optional[str]:
        """Collective (when active): why every rank should stop now, or None (posts first if nobody did)."""
        if not self.active:
            return None
        self.post()
        started = time.perf_counter()
        flags, work = self._pending
        self._pending = None
        if work is not None:
            work.wait()
        signum, timed_out = int(flags[0]), bool(flags[1])
        self.blocked_s += time.perf_counter() - started
        if signum:
            return f"received {signal.Signals(signum).name} (--exit-signal-handler)"
        if timed_out:
            return f"the run has lasted {self.limit_s / 60:g} minutes (--exit-duration-in-mins)"
        return None

    def ignore_further(self) -> None:
        """Stopping: ignore the handled signals from now on (the save runs to its end)."""
        for sig in self._previous:
            signal.signal(sig, signal.SIG_IGN)

    def close(self, failed: bool = False) -> None:
        """Restore the handlers. A loop that ended without reading its last agreement waits for it, unless
        the run `failed`: then a peer may be gone and the all_reduce never completes (the process exits)."""
        if self._pending is not None and self._pending[1] is not None and not failed:
            self._pending[1].wait()
        self._pending = None
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}
