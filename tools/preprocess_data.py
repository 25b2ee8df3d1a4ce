"""Tokenize a corpus into Megatron mmap datasets ``{output_prefix}_{key}_document.{bin,idx}``.

Input formats (``--text-format``, default ``auto``: ``jsonl`` for .jsonl/.json files, ``parquet`` for .parquet,
``lines`` otherwise; a ``.gz`` or ``.zst`` suffix is read through, e.g. ``corpus.jsonl.zst`` is compressed jsonl):
  jsonl       one JSON object per line; one output dataset per ``--json-keys`` key
  lines       one document per line
  paragraphs  documents separated by blank lines (their internal newlines are kept)
  parquet     one document per row; one output dataset per ``--json-keys`` column (string columns; a null is a
              bad record, as JSON's null is; errors name the row, counted from 0)
For the two text formats the single ``--json-keys`` name (default ``text``) only names the output.
Blank lines in jsonl are empty documents; an empty text is an empty document for every tokenizer.
Compressed and Parquet inputs are streamed and give the same .bin/.idx as the plain jsonl; a damaged file
(truncated, corrupt, no Parquet footer) is one ``error:`` line naming it.

Each document becomes one item (plus ``eod`` with ``--append-eod``); documents with no tokens are skipped
and counted. The input is streamed: at most ``workers * chunksize * 4`` documents are in flight, so memory
stays bounded for inputs larger than RAM. Outputs are written under temporary names in the output
directory and renamed at the end; on any error the temporaries are removed and nothing is left behind. Beside
each pair goes its checksum sidecar ``{output_prefix}_{key}_document.crc.json`` (megatron/data/checksums.py),
which training checks the pair against as it reads it; the .bin and .idx are the same with or without it.

Example::

    python tools/preprocess_data.py --input corpus.jsonl --output-prefix data/my-gpt2 \\
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt \\
        --append-eod --workers 2
"""
from megatron.data.preprocessing import main
from megatron.errors import exit_on_user_error

if __name__ == "__main__":
    exit_on_user_error(main)
