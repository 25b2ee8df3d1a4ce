"""Check a pretraining command line in one process before launching the world.

    python -m megatron.config.preflight {gpt,t5} --world-size N [--args-only] [pretrain_*.py arguments]

runs the entry point's own argument resolution (`megatron.config.arguments.parse_args`, with the world size the
launcher will create) and `check_inputs` (data, tokenizer and DeepSpeed config files), prints
`error: <message>` and exits 2 on the first mistake, or exits 0 silently. It imports neither torch nor
DeepSpeed, so a mistake is reported in about a second instead of after N processes have started; the
example scripts run it before every launch (`CHECK_ARGS=0` skips it).

`check_inputs` also runs at the start of every pretraining process (`deep=False`: files exist); the
preflight also opens each dataset's index (`deep=True`: header, sizes, .bin length, and the .idx against the
pair's checksum sidecar where it has one: `megatron.data.checksums`) and builds the tokenizer from its files
(vocab.json and merges.txt, the SentencePiece model, tokenizer.json).
"""
from __future__ import annotations

import argparse
import os
import sys
from typing import List, Optional, Sequence

from megatron.config.arguments import ENTRY_DEFAULTS, parse_args
from megatron.errors import UserError, exit_on_user_error, one_line
from megatron.tokenizer.hf_tokenizer import tokenizer_json_path

ENTRY_POINTS = {"gpt": "pretrain_gpt2.py", "t5": "pretrain_t5.py"}


def _data_prefixes(data_path: Sequence[str]) -> List[str]:
    return list(data_path) if len(data_path) == 1 else list(data_path[1::2])


def _check_prefix(prefix: str, deep: bool) -> None:
    for ext in (".idx", ".bin"):
        if not os.path.isfile(prefix + ext):
            hint = " (give the prefix, without .bin/.idx)" if prefix.endswith((".bin", ".idx")) else ""
            raise UserError(f"--data-path {prefix}: {prefix}{ext} not found{hint}; tools/preprocess_data.py "
                            f"writes <output-prefix>_text_document.bin/.idx")
    if deep:
        from megatron.data.indexed_dataset import MMapIndexedDataset  # numpy only
        MMapIndexedDataset(prefix)  # raises IndexedDatasetError (a UserError) for a bad pair


def _check_file(flag: str, path: Optional[str], needed_by: str) -> None:
    if path is None:
        raise UserError(f"{needed_by} needs {flag} FILE")
    if not os.path.isfile(path):
        raise UserError(f"{flag} {path}: file not found")


def build_tokenizer_from_args(args: argparse.Namespace):
    """The tokenizer the arguments name; a file that does not load is a UserError naming it."""
    from megatron.tokenizer import build_tokenizer
    try:
        return build_tokenizer(args.tokenizer_type, args.vocab_file, args.merge_file, args.tokenizer_model,
                               args.vocab_extra_ids)
    except (OSError, ValueError) as err:
        if isinstance(err, UserError):
            raise
        raise UserError(f"cannot build the {args.tokenizer_type}: {one_line(err)}") from err


def check_inputs(args: argparse.Namespace, deep: bool = False) -> None:
    """The data prefixes and tokenizer files the arguments name exist (deep: and the datasets open, and the
    tokenizer loads)."""
    if not args.data_path:
        raise UserError("--data-path is required: PREFIX of a preprocessed .bin/.idx pair, or WEIGHT PREFIX ...")
    for prefix in _data_prefixes(args.data_path):
        _check_prefix(prefix, deep)
    if args.tokenizer_type == "GPT2BPETokenizer":
        _check_file("--vocab-file", args.vocab_file, "--tokenizer-type GPT2BPETokenizer")
        _check_file("--merge-file", args.merge_file, "--tokenizer-type GPT2BPETokenizer")
    elif args.tokenizer_type == "SentencePieceTokenizer":
        _check_file("--tokenizer-model", args.tokenizer_model, "--tokenizer-type SentencePieceTokenizer")
    elif args.tokenizer_type == "HuggingFaceTokenizer":
        tokenizer_json_path(args.tokenizer_model)
    if deep:  # the files load and agree (a few hundred ms for a 100k-token vocabulary)
        build_tokenizer_from_args(args)


def _parse(argv: Sequence[str]) -> tuple:
    p = argparse.ArgumentParser(prog="python -m megatron.config.preflight", add_help=False)
    p.add_argument("model", choices=sorted(ENTRY_POINTS))
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--args-only", action="store_true", help="skip check_inputs (files not built yet)")
    own, rest = p.parse_known_args(argv)
    return own, rest


def main(argv: Optional[Sequence[str]] = None) -> None:
    own, rest = _parse(sys.argv[1:] if argv is None else argv)
    if own.world_size < 1:
        raise UserError(f"--world-size must be >= 1, got {own.world_size}")
    args = parse_args(rest, defaults=ENTRY_DEFAULTS[own.model], world_size=own.world_size,
                      prog=ENTRY_POINTS[own.model])
    if not own.args_only:
        check_inputs(args, deep=True)


if __name__ == "__main__":
    exit_on_user_error(main)
