"""Small deterministic corpus and tokenizers for tests (reused across the test suite).

    make_corpus(dir) -> path of a jsonl file ({"text": ...} per line, ~300 varied documents)
    make_bpe(dir, vocab_size=500) -> (vocab.json, merges.txt)
    make_spm(dir, vocab_size=600) -> spm.model
    make_hf_bpe(dir, vocab_size=500) -> folder with tokenizer.json + tokenizer_config.json (eos <|endoftext|>)
    make_llama_like(dir) -> folder: make_hf_bpe's tokenizer with Llama-3's special tokens, a post-processor that
        adds <|begin_of_text|> (Llama-3's TemplateProcessing) and a truncation setting that must be ignored

make_bpe's vocab has exactly vocab_size entries (<|endoftext|> = 0); make_spm's model may have fewer pieces
than asked on this small corpus (hard_vocab_limit=False; 600 gives 467): read the size from the tokenizer.

The tokenizers are trained in this process by tools/train_tokenizer.py's functions: this module imports the
checkout's tools/ package, which is on sys.path where pytest runs (not in a bench script: bench uses
harness.example_data, which runs the tools as scripts).
"""
import json
import os
import random
from typing import List, Tuple

from megatron.tokenizer.training import iter_texts, train_bpe, train_hf_bpe, train_sentencepiece

WORDS = ("the model data parallel pipeline tensor stage gradient token layer attention batch "
         "optimizer schedule checkpoint memory throughput sequence embedding vocabulary").split()
SNIPPETS = [
    "Café déjà vu, naïve façade; Ærøskøbing, Straße, crème brûlée.",
    "東京は日本の首都です。中文文本测试，标点符号！",
    "Emoji: 🙂🚀🧪 and flags 🇫🇷 with ZWJ 👩‍💻.",
    "tabs\tand  double  spaces   and trailing spaces   ",
    "line one\nline two\n\nafter a blank line\n",
    "numbers 3.14159 1,000,000 2026-11-22 and 0x1F.",
    "code: def f(x): return x ** 2  # comment",
    "quotes \"double\" 'single' it's they're we've I'm you'll he'd",
    "Ελληνικά και русский текст и العربية",
]


def make_texts(n_docs: int = 300, seed: int = 0) -> List[str]:
    """Documents of random sentences mixed with the fixed multilingual snippets."""
    rng = random.Random(seed)
    texts = []
    for i in range(n_docs):
        sentences = []
        for _ in range(rng.randint(1, 6)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(3, 15))]
            sentences.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ","]))
        if i % 3 == 0:
            sentences.insert(rng.randint(0, len(sentences)), rng.choice(SNIPPETS))
        texts.append(rng.choice([" ", "\n", "  "]).join(sentences))
    return texts


def make_corpus(dir_path: str, n_docs: int = 300, seed: int = 0) -> str:
    path = os.path.join(dir_path, "corpus.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for text in make_texts(n_docs, seed):
            f.write(json.dumps({"text": text}) + "\n")
    return path


def make_bpe(dir_path: str, vocab_size: int = 500) -> Tuple[str, str]:
    corpus = make_corpus(dir_path)
    return train_bpe(iter_texts(corpus), vocab_size, os.path.join(dir_path, "bpe"))


def make_spm(dir_path: str, vocab_size: int = 600) -> str:
    corpus = make_corpus(dir_path)
    return train_sentencepiece(iter_texts(corpus), vocab_size, os.path.join(dir_path, "spm"))


def make_hf_bpe(dir_path: str, vocab_size: int = 500) -> str:
    corpus = make_corpus(dir_path)
    folder = os.path.join(dir_path, "hf")
    train_hf_bpe(iter_texts(corpus), vocab_size, folder)
    return folder


LLAMA3_SPECIAL = ("<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>")


def make_llama_like(dir_path: str) -> str:
    from tokenizers import Tokenizer, processors

    tokenizer = Tokenizer.from_file(os.path.join(make_hf_bpe(dir_path), "tokenizer.json"))
    tokenizer.add_special_tokens(list(LLAMA3_SPECIAL))
    bos = (LLAMA3_SPECIAL[0], tokenizer.token_to_id(LLAMA3_SPECIAL[0]))
    tokenizer.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos[0]} $A", pair=f"{bos[0]} $A {bos[0]} $B:1", special_tokens=[bos]),
    ])
    tokenizer.enable_truncation(8)  # transformers does not truncate unless asked, and neither may we
    folder = os.path.join(dir_path, "llama")
    os.makedirs(folder)
    tokenizer.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": LLAMA3_SPECIAL[0],
              "eos_token": LLAMA3_SPECIAL[1]}
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f)
    return folder
