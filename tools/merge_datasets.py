"""Concatenate mmap indexed datasets into one: items, tokens and documents in input order.

doc_idx is merged correctly (``offset + other.doc_idx[1:]``), unlike old Megatron's ``merge_file_``.
``--input`` takes dataset prefixes, or one directory whose ``*.idx``/``*.bin`` pairs are merged in
sorted name order. All inputs must share one dtype. An input with a checksum sidecar is checked against it
in full before it is copied; the output gets a sidecar of its own (megatron/data/checksums.py). The output is
written under temporary names and renamed at the end.

Example::

    python tools/merge_datasets.py --input data/part0_text_document data/part1_text_document \\
        --output-prefix data/all_text_document
"""
import argparse
import os
import sys
from typing import List, Optional


from megatron.config.arguments import ArgumentParser
from megatron.data import checksums
from megatron.data.indexed_dataset import (MMapIndexedDataset, MMapIndexedDatasetBuilder,
                                           data_file_path, index_file_path)
from megatron.errors import UserError, exit_on_user_error


class MergeError(UserError):
    """Bad inputs: `error: <message>` on one line and exit status 2 (megatron.errors); a bad .bin/.idx pair
    raises IndexedDatasetError, also a UserError."""


def expand_inputs(inputs: List[str]) -> List[str]:
    """Prefixes from prefixes or a single directory."""
    if len(inputs) == 1 and os.path.isdir(inputs[0]):
        directory = inputs[0]
        prefixes = sorted(os.path.join(directory, name[:-4]) for name in os.listdir(directory)
                          if name.endswith(".idx"))
        if not prefixes:
            raise MergeError(f"no .idx files in directory {directory!r}")
        return prefixes
    return inputs


def merge_datasets(prefixes: List[str], output_prefix: str) -> MMapIndexedDataset:
    """Merge ``prefixes`` into ``output_prefix``; returns the merged dataset."""
    datasets = []
    for prefix in prefixes:
        if not MMapIndexedDataset.exists(prefix):
            raise MergeError(f"dataset {prefix!r} not found ({prefix}.bin and {prefix}.idx needed)")
        if os.path.abspath(prefix) == os.path.abspath(output_prefix):
            raise MergeError(f"output prefix {output_prefix!r} is also an input")
        datasets.append(MMapIndexedDataset(prefix))
    for prefix, dataset in zip(prefixes, datasets):
        if dataset.dtype != datasets[0].dtype:
            raise MergeError(f"dtype mismatch: {prefixes[0]} is {datasets[0].dtype} but {prefix} is "
                             f"{dataset.dtype}; preprocess all inputs with the same tokenizer")
    for dataset in datasets:
        dataset.check_bytes()  # the merged sidecar must not vouch for a damaged input
    temp = f"{output_prefix}.tmp{os.getpid()}"
    paths = [(temp + suffix, output_prefix + suffix) for suffix in (".bin", ".idx", checksums.SUFFIX)]
    builder = MMapIndexedDatasetBuilder(data_file_path(temp), dtype=datasets[0].dtype)
    try:
        for prefix in prefixes:
            builder.merge_file_(prefix)
        builder.finalize(index_file_path(temp))
        checksums.write(temp)
        for path, final in paths:
            os.replace(path, final)
    except BaseException:
        builder.abort()
        for path, _ in paths:
            if os.path.exists(path):
                os.remove(path)
        raise
    return MMapIndexedDataset(output_prefix)


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--input", nargs="+", required=True, help="dataset prefixes, or one directory of them")
    p.add_argument("--output-prefix", required=True)
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> MMapIndexedDataset:
    """The CLI; a mistake raises a UserError (run as a script: `error: ...`, exit 2)."""
    args = get_args(argv)
    prefixes = expand_inputs(args.input)
    os.makedirs(os.path.dirname(os.path.abspath(args.output_prefix)), exist_ok=True)
    merged = merge_datasets(prefixes, args.output_prefix)
    print(f"merged {len(prefixes)} datasets: {len(merged)} items, {len(merged.doc_idx) - 1} documents, "
          f"{int(merged.sizes.sum())} tokens (largest id {merged.token_id_range()[1]}) -> {args.output_prefix}",
          file=sys.stderr)
    return merged


if __name__ == "__main__":
    exit_on_user_error(main)
