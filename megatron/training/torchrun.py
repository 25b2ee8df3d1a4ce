"""torchrun that a SIGTERM or SIGUSR1 does not stop: it passes the signal to its workers and waits for them.

    python -m megatron.training.torchrun [torchrun's arguments] pretrain_gpt2.py ...

torchrun itself stops its workers when it receives SIGTERM (SIGTERM to each, SIGKILL 30 s later, then exits 1
with a traceback) and dies of SIGUSR1. A scheduler's time limit or preemption, `scancel`, systemd's stop or
`kill -- -PGID` send the signal to every process of the job at once, torchrun included, so the workers, which
save a checkpoint and exit 0 on that signal (--exit-signal-handler), would be killed or orphaned. Here
torchrun runs unchanged (`torch.distributed.run.main`) except that SIGTERM and SIGUSR1 are left out of the
signals it handles (its --signals-to-handle, TORCHELASTIC_SIGNALS_TO_HANDLE before torch 2.7) and handled by forwarding them to this process's
children, the workers; torchrun then sees them exit 0 and exits 0 (`--max-restarts` restarts failed workers as
before; SIGINT, SIGHUP and SIGQUIT keep torchrun's handling). The example scripts launch through it.
"""
from __future__ import annotations

import os
import signal
import sys

FORWARDED = (signal.SIGTERM, signal.SIGUSR1)
TORCHRUN_HANDLES = "SIGINT,SIGHUP,SIGQUIT"


def forward(signum: int, frame) -> None:
    """Send `signum` to this process's children (the workers), once each."""
    import psutil
    for child in psutil.Process().children(recursive=False):
        try:
            child.send_signal(signum)
        except psutil.Error:
            pass


def main() -> None:
    from torch.distributed import run
    os.environ["TORCHELASTIC_SIGNALS_TO_HANDLE"] = TORCHRUN_HANDLES  # torch < 2.7 reads only this
    flag = "--signals-to-handle"
    if flag in run.get_args_parser()._option_string_actions and \
            not any(a.startswith((flag, "--signals_to_handle")) for a in sys.argv[1:]):
        sys.argv[1:1] = [f"{flag}={TORCHRUN_HANDLES}"]  # newer torch sets the variable from this flag
    for sig in FORWARDED:
        signal.signal(sig, forward)
    run.main()


if __name__ == "__main__":
    main()
