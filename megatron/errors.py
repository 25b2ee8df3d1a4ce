"""The one exception class for mistakes a user can fix: arguments and their combinations, the DeepSpeed
JSON, data and tokenizer files, checkpoints that do not match the run.

Raise `UserError` (or a subclass) with one line that names the problem, the values and what to do. The
entry points (`pretrain_*.py`) and every CLI under `tools/` catch it, print `error: <message>` once and exit
with status 2, without a traceback. Any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations

import os
import sys
from typing import Callable


class UserError(ValueError):
    """A mistake in the user's input; the message is the whole report (one line, with the values)."""


def exit_on_user_error(main: Callable[[], object]) -> object:
    """Run `main()`; a UserError prints `error: <message>` once (rank 0 of the launch, from RANK) to stderr and
    exits with status 2, without a traceback. Other exceptions propagate with their traceback."""
    try:
        return main()
    except UserError as err:
        if os.environ.get("RANK", "0") == "0":
            print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
