"""Train a tokenizer on a corpus, offline: jsonl, Parquet or text, as megatron.data.corpus reads them
(``.jsonl.gz``, ``.jsonl.zst`` and ``.parquet`` included; ``--json-key`` names the key or Parquet column).

``--type bpe``: byte-level BPE with the ``tokenizers`` library -> ``vocab.json`` + ``merges.txt``, with
``<|endoftext|>`` as the special token (id 0) and all 256 byte symbols; loadable by ``GPT2BPETokenizer``.

``--type hf-bpe``: the same byte-level BPE saved as a Hugging Face ``tokenizer.json`` + ``tokenizer_config.json``
(which names ``<|endoftext|>`` as its eos); loadable by ``HuggingFaceTokenizer`` (``--tokenizer-model`` the
folder) and by transformers. Both files are written under temporary names and renamed.

``--type sentencepiece``: unigram SentencePiece -> ``spm.model`` (+ ``spm.vocab``), T5 ids
(pad=0, eos=1, unk=2, no bos). Lossless settings: identity normalization, whitespace kept, byte fallback
for characters outside the vocabulary. Documents are fed line by line (newlines become byte pieces).

Example::

    python tools/train_tokenizer.py --input corpus.jsonl --type bpe --vocab-size 32000 --output-dir tok/
    python tools/train_tokenizer.py --input corpus.jsonl.zst --type hf-bpe --vocab-size 32000 --output-dir hf-tok/
"""
from megatron.errors import exit_on_user_error
from megatron.tokenizer.training import main

if __name__ == "__main__":
    exit_on_user_error(main)
