"""pretrain_gpt2.py, except that global rank KILL_RANK kills itself (SIGKILL) when iteration KILL_AT starts, in
the first attempt under torchrun only (TORCHELASTIC_RESTART_COUNT 0): a node lost mid-run."""
import os
import signal
import sys

from megatron.errors import exit_on_user_error
from megatron.training import loop
from megatron.training.pretrain import run
from pretrain_gpt2 import DEFAULTS, SPEC

KILL_AT, KILL_RANK = int(os.environ["KILL_AT"]), int(os.environ["KILL_RANK"])
_start = loop.start_iteration


def start_iteration(module, iteration, replica=(0, 1)):
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0"
    if first_attempt and iteration + 1 == KILL_AT and int(os.environ["RANK"]) == KILL_RANK:
        print(f"rank {KILL_RANK}: killing itself at iteration {KILL_AT}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    return _start(module, iteration, replica)


if __name__ == "__main__":
    loop.start_iteration = start_iteration
    exit_on_user_error(lambda: run(sys.argv[1:], SPEC, DEFAULTS))
