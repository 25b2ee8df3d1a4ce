"""The one exception class for mistakes a user can fix: arguments and their combinations, the DeepSpeed
JSON, data and tokenizer files, checkpoints that do not match the run.

Raise `UserError` (or a subclass) with one line that names the problem, the values and what to do. The
entry points (`pretrain_*.py`) and every CLI under `tools/` catch it, print `error: <message>` once and exit
with status 2, without a traceback. Any other exception is a bug and keeps its traceback.
"""
from __future__ import annotations


class UserError(ValueError):
    """A mistake in the user's input; the message is the whole report (one line, with the values)."""
