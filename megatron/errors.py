"""The one exception class for mistakes a user can fix: arguments and their combinations, the DeepSpeed
JSON, data and tokenizer files, checkpoints that do not match the run.

Raise `UserError` (or a subclass) with one line that names the problem, the values and what to do. The
entry points (`pretrain_*.py`) and every CLI under `tools/` run their main through `exit_on_user_error`:
a UserError prints `error: <message>` once and exits with status 2, without a traceback. Any other
exception is a bug and keeps its traceback (`MEGATRON_TRACEBACK=1` shows it for a UserError too).

Once per launch, not once per rank. A launch of N processes may see the mistake on every rank (arguments)
or on some (a data file read by tensor-parallel rank 0 only). The first rank to report it creates a
marker file with O_EXCL, and only that rank prints; the others exit 2 silently:

    MEGATRON_ERROR_FILE set (the example scripts)   that file; the script prints its content once, after the
                                                    launcher has stopped every process, and exits 2
    otherwise, several processes                    <tmp>/megatron-error-<launcher pid>-<its start time>-
                                                    <MASTER_PORT>, shared by the processes of one launcher
                                                    on one node (with several nodes: once per node)

The ranks that did not see the mistake are blocked in a collective with a rank that has exited, or are
stopped by the launcher (torchrun and DeepSpeed stop all processes when one exits non-zero). Whatever
such a rank raises once the marker exists is a consequence, not a second error: it exits 2 silently
instead of printing a traceback (gloo's "Connection closed by peer" and the like).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from typing import Callable, NoReturn, Optional

ERROR_FILE_ENV = "MEGATRON_ERROR_FILE"
USER_ERROR_STATUS = 2


class UserError(ValueError):
    """A mistake in the user's input; the message is the whole report (one line, with the values)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes (unknown flag, bad value) are one-line UserErrors, not the usage text."""

    def error(self, message: str) -> NoReturn:
        raise UserError(f"{message} ({self.prog} --help lists the arguments)")


def require(condition: bool, message: str) -> None:
    """Raise UserError(message) unless `condition`."""
    if not condition:
        raise UserError(message)


def flag_name(dest: str) -> str:
    """The command-line flag of an argparse destination: 'num_layers' -> '--num-layers'."""
    return "--" + dest.replace("_", "-")


def one_line(message: str) -> str:
    """The message on one line (a multi-line message from a library is joined with ' | ')."""
    return " | ".join(part.strip() for part in str(message).strip().splitlines() if part.strip())


_WORKER = re.compile(r"Caught (\w+) in DataLoader worker process \d+\.\nOriginal Traceback")


def worker_message(message: str) -> str:
    """The user's message of an error raised in a DataLoader worker. torch re-raises it in the main process as
    the same class with the message 'Caught <Class> in DataLoader worker process N.' + the worker's traceback,
    whose last '<module>.<Class>: ' line holds the original message; any other message is returned as it is."""
    match = _WORKER.match(message)
    if match is None:
        return message
    original = re.findall(rf"^(?:[\w.]+\.)?{match[1]}: (.*)$", message, re.M)
    return original[-1] if original else message


def _marker_path() -> Optional[str]:
    """Where this launch records its first user error; None for a single process."""
    explicit = os.environ.get(ERROR_FILE_ENV)
    if explicit:
        return explicit
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    launcher = os.getppid()
    try:  # the launcher's start time: a later launch that reuses its pid does not see this marker
        started = int(os.stat(f"/proc/{launcher}").st_ctime)
    except OSError:
        started = 0
    name = f"megatron-error-{launcher}-{started}-{os.environ.get('MASTER_PORT', '0')}"
    return os.path.join(tempfile.gettempdir(), name)


def _claim(path: str, message: str) -> bool:
    """Create `path` holding `message`; False if another process of the launch created it first."""
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        f.write(message + "\n")
    return True


def report_user_error(err: BaseException) -> None:
    """Print `error: <message>` to stderr unless another process of this launch reported first (or the
    example script will print it from MEGATRON_ERROR_FILE)."""
    message = one_line(worker_message(str(err)))
    path = _marker_path()
    first = path is None or _claim(path, message)
    if first and not os.environ.get(ERROR_FILE_ENV):
        sys.stderr.write(f"error: {message}\n")  # one write: ranks share the stream
        sys.stderr.flush()


def another_rank_reported() -> bool:
    path = _marker_path()
    return path is not None and os.path.exists(path)


def _distributed() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _exit(status: int) -> None:
    """Exit; with torch.distributed initialised, without running destructors: a process group whose peer
    has gone holds joinable threads, and destroying them at interpreter exit aborts the process
    ("terminate called without an active exception", SIGABRT) or hangs until the launcher's SIGKILL (torchrun
    waits 30 s before it restarts the ranks) instead of returning `status`."""
    if _distributed():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    sys.exit(status)


def exit_on_user_error(main: Callable[[], object]) -> object:
    """Run `main()`; a UserError is reported once per launch (see the module docstring) and exits with
    status 2, without a traceback. Another exception exits 2 silently if a rank of this launch already
    reported a user error (it is a consequence); otherwise it propagates with its traceback (with
    torch.distributed initialised: the traceback is printed and the process exits 1 at once)."""
    try:
        return main()
    except UserError as err:
        if os.environ.get("MEGATRON_TRACEBACK"):
            import traceback
            traceback.print_exc()
        report_user_error(err)
        _exit(USER_ERROR_STATUS)
    except Exception:
        if another_rank_reported():
            _exit(USER_ERROR_STATUS)
        if _distributed():  # a bug, or a peer that died: the traceback, then out at once (see _exit)
            import traceback
            traceback.print_exc()
            _exit(1)
        raise
