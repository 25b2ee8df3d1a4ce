"""How the campaign decides a case's status, from what the command did with the mutated file, what the pristine
run gave, and what the file's owner reads in it (harness/faults/owners.py). The rules, tried in this order:

    refused     the command refused in one line naming the file: in this process a UserError whose message
                names the mutated file; through the user's command (the subprocess subset) exit 2 and one
                stderr line `error: <that message>`
    unnamed     refused without naming the file
    hang        no result within drivers.CASE_TIMEOUT_S
    traceback   any other exception
    silent      accepted a file its owner's reader refuses
    unchanged   accepted, and the whole result equals the pristine run's (results.py: the normalization rule)
    silent      a changed result, where the file kind has integrity records or an own format to check and no
                edit to follow (data, manifest, checkpoint files, safetensors, `latest`)
    as written  a changed result, exactly as the owner's reading of the file says (the kind's `follow` rule)
    silent      a changed result where the owner's reading does not explain it

The two `follow` rules:
    follow_tokenizer  the result's tokenizer part equals what the owner's tokenizer gives (vocabulary size,
                      special ids, the ids of the fixed texts, SentencePiece's pieces) and every other part
                      equals the pristine run's, but for the configuration's vocabulary sizes, which follow the
                      owner's (vocab_size; padded_vocab_size, padded as Megatron pads)
    follow_values     every leaf of the result that changed went from a value the file held to the value it
                      holds now, at a key the owner's diff of the file shows changed (json: a value edited, a
                      key added or removed); a change the file does not show is unexplained
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, List, Optional, Tuple

from harness.faults.results import MISSING, changes, describe, same

Change = Tuple[Tuple, Any, Any]


def follow_tokenizer(pristine_reading: Any, reading: Any, pristine_result: dict, result: dict) -> List[Change]:
    """The changes of `result` that the owner's tokenizer reading (results.tokenizer_result's form) does not give:
    its tokenizer part must be the reading, and the rest the pristine run's but for the vocabulary sizes the run
    derives from the tokenizer (`vocab_size` = the reading's, `padded_vocab_size` = that padded as Megatron pads,
    to a multiple of make_vocab_size_divisible_by x tp)."""
    from megatron.model.config import padded_vocab_size
    config = result.get("config", {})
    vocab = reading["vocab_size"]
    derived = {"vocab_size": vocab, "padded_vocab_size": padded_vocab_size(
        vocab, config.get("record", {}).get("make_vocab_size_divisible_by", 1), config.get("layout", {}).get("tp", 1))}
    return [(path, old, new) for path, old, new in changes(dict(pristine_result, tokenizer=reading), result)
            if not (path[0] == "config" and path[-1] in derived and same(new, derived[path[-1]]))]


def follow_values(pristine_reading: Any, reading: Any, pristine_result: Any, result: Any) -> List[Change]:
    """The changes of `result` that are not a value of the file going from its old to its new value."""
    edits = [(old, new) for _, old, new in changes(pristine_reading, reading)]
    emptied = ({}, [], MISSING)  # an object left empty (or made) by a removed (added) key: structure, not a value
    return [(path, old, new) for path, old, new in changes(pristine_result, result)
            if not any(same(old, o) and same(new, n) for o, n in edits)
            and not (old in emptied and new in emptied)]


def names_file(target: str, message: str) -> bool:
    """The line names the mutated file: its path relative to the case folder, or its name (a line may name the
    folder's file, e.g. `ckpt/latest names ...`)."""
    return target in message or os.path.basename(target) in message


@dataclass
class OwnerView:
    """What the file's owner reads in the pristine file and in the mutated one."""
    pristine: Any = None
    mutated: Any = None
    refuses: Optional[str] = None  # the owner reader's refusal of the mutated file
    says: str = ""                 # the change in the owner's terms, for the report


def judge(target: str, status: str, value: Any, pristine_result: Any, follow, owner: OwnerView) -> Tuple[str, str]:
    """(status, detail) of one case. `status`/`value`: the command's outcome ("ok" and its result, "UserError"
    and its line, "Hang" or an exception class and its message); `follow`: the kind's rule, None where a changed
    result must be refused."""
    if status == "UserError":
        return ("refused" if names_file(target, value) else "unnamed"), value
    if status == "Hang":
        return "hang", value
    if status != "ok":
        return "traceback", f"{status}: {value}"
    if owner.refuses is not None:
        return "silent", f"accepted a file its owner refuses ({owner.refuses[:160]})"
    diff = changes(pristine_result, value)
    if not diff:
        return "unchanged", ""
    if follow is None:
        return "silent", f"a changed result from a file with integrity records: {describe(diff)}"
    unexplained = follow(owner.pristine, owner.mutated, pristine_result, value)
    if unexplained:
        return "silent", f"a change the file does not say: {describe(unexplained)}"
    return "as written", f"the file says {owner.says or describe(changes(owner.pristine, owner.mutated))}"


def same_outcome(in_process: Tuple[str, str], through_command: Tuple[str, str]) -> Optional[str]:
    """None when the user's command (a subprocess) gave the status and line of the in-process run."""
    if in_process[0] != through_command[0]:
        return f"{through_command[0]} through the command, {in_process[0]} in process: {through_command[1][:200]}"
    if in_process[0] in ("refused", "unnamed") and in_process[1] != through_command[1]:
        return f"another line: {through_command[1][:200]} (in process: {in_process[1][:200]})"
    return None
