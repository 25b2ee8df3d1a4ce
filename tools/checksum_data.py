"""Add the checksum sidecar ``<prefix>.crc.json`` to preprocessed ``.bin``/``.idx`` pairs, or verify pairs
against theirs (docs/data.md#the-checksum-sidecar; the format: megatron/data/checksums.py).

tools/preprocess_data.py and tools/merge_datasets.py write the sidecar themselves; this adds it to data made by
other tools (Megatron-LM's) without tokenizing again. Training checks a pair against its sidecar as it reads it.

Example::

    python tools/checksum_data.py --data-path data/web_text_document data/books_text_document
    python tools/checksum_data.py --verify --data-path data/web_text_document
"""
import argparse
import sys
from typing import List, Optional

from megatron.config.arguments import ArgumentParser
from megatron.data.checksum_data import add_sidecar, verify_pair
from megatron.data.checksums import CHUNK_BYTES, sidecar_path
from megatron.errors import exit_on_user_error


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data-path", nargs="+", required=True, metavar="PREFIX",
                   help="dataset prefixes (<prefix>.bin and <prefix>.idx)")
    p.add_argument("--verify", action="store_true",
                   help="check each pair against its sidecar (the .idx, then every chunk of the .bin) instead of "
                        "writing one")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing sidecar (only from a good copy of the pair)")
    p.add_argument("--chunk-bytes", type=int, default=CHUNK_BYTES,
                   help="bytes of .bin per CRC-32: a damaged chunk is refused when training first reads it")
    return p.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> None:
    """The CLI; a damaged pair or sidecar raises a UserError (run as a script: `error: ...`, exit 2)."""
    args = get_args(argv)
    for prefix in args.data_path:
        if args.verify:
            sidecar = verify_pair(prefix)
            print(f"ok: {prefix}.idx and the {len(sidecar.bin_crc32)} chunks of {prefix}.bin match "
                  f"{sidecar_path(prefix)}", file=sys.stderr)
        else:
            sidecar = add_sidecar(prefix, args.chunk_bytes, args.overwrite)
            print(f"wrote {sidecar_path(prefix)}: {len(sidecar.bin_crc32)} chunks of {sidecar.chunk_bytes} bytes "
                  f"({sidecar.bin_bytes} bytes of .bin) and the .idx", file=sys.stderr)


if __name__ == "__main__":
    exit_on_user_error(main)
