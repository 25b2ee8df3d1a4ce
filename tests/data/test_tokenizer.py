"""Tokenizers: GPT-2 BPE backends agree with each other and with HF's own ByteLevelBPETokenizer; SentencePiece ids."""
import json
import random

import pytest

from megatron.tokenizer import SentencePieceTokenizer, build_tokenizer
from megatron.tokenizer.gpt2_bpe import GPT2BPETokenizer
from harness.corpus import SNIPPETS, make_bpe, make_spm, make_texts

TEXTS = SNIPPETS + make_texts(40, seed=7) + [
    "", " ", "\n", "\n\n\n", "   leading and trailing   ", "a\u00a0b\u2003c\u3000d",
    "<|endoftext|>", "doc one<|endoftext|>doc two", "<extra_id_0> is plain text",
    "ünïcödé 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 \U0001F600\U0001F600", "mixed 123abc 4.5e-3 ''' \"\"\" \r\n windows line",
]


@pytest.fixture(scope="module")
def bpe_files(tmp_path_factory):
    return make_bpe(str(tmp_path_factory.mktemp("bpe")), vocab_size=500)


@pytest.fixture(scope="module")
def spm_model(tmp_path_factory):
    return make_spm(str(tmp_path_factory.mktemp("spm")), vocab_size=600)


def test_bpe_backends_identical_and_round_trip(bpe_files):
    fast = GPT2BPETokenizer(*bpe_files, backend="tokenizers")
    slow = GPT2BPETokenizer(*bpe_files, backend="python")
    assert (fast.backend, slow.backend) == ("tokenizers", "python")
    for text in TEXTS:
        ids = fast.tokenize(text)
        assert slow.tokenize(text) == ids, text
        assert fast.detokenize(ids) == text and slow.detokenize(ids) == text


def random_unicode(rng, n_texts=300):
    """Random strings mixing whitespace/contraction characters with letters, marks, CJK, emoji, private use."""
    ranges = [(0, 0x7F), (0x80, 0x36F), (0x400, 0x4FF), (0x590, 0x6FF), (0x900, 0x97F), (0x2000, 0x206F),
              (0x3000, 0x30FF), (0x4E00, 0x4F00), (0xAC00, 0xAD00), (0x1F300, 0x1F6FF), (0xE000, 0xE0FF)]
    for _ in range(n_texts):
        chars = [rng.choice(" \t\n\r\x0b\x0c\u00a0's") if rng.random() < 0.4 else chr(rng.randint(*rng.choice(ranges)))
                 for _ in range(rng.randint(0, 40))]
        yield "".join(chars)


def test_bpe_backends_agree_on_random_unicode(bpe_files):
    fast = GPT2BPETokenizer(*bpe_files, backend="tokenizers")
    slow = GPT2BPETokenizer(*bpe_files, backend="python")
    for text in random_unicode(random.Random(0)):
        ids = fast.tokenize(text)
        assert slow.tokenize(text) == ids and slow.detokenize(ids) == text, repr(text)


def test_bpe_matches_hf_bytelevel_reference(bpe_files):
    """Independent reference: the tokenizers library's own ByteLevelBPETokenizer on the same files."""
    from tokenizers import ByteLevelBPETokenizer

    reference = ByteLevelBPETokenizer(*bpe_files, add_prefix_space=False)
    ours = GPT2BPETokenizer(*bpe_files, backend="python")
    for text in TEXTS:
        assert ours.tokenize(text) == reference.encode(text).ids, text


def test_bpe_merges_compress(bpe_files):
    tokenizer = build_tokenizer("GPT2BPETokenizer", *bpe_files)
    text = " ".join(make_texts(5, seed=1))
    assert len(tokenizer.tokenize(text)) < 0.5 * len(text.encode("utf-8"))


def test_endoftext_inside_text_is_not_special(bpe_files):
    tokenizer = build_tokenizer("GPT2BPETokenizer", *bpe_files)
    ids = tokenizer.tokenize("a<|endoftext|>b")
    assert tokenizer.eod not in ids and len(ids) > 3
    assert tokenizer.detokenize(ids + [tokenizer.eod]) == "a<|endoftext|>b<|endoftext|>"


def test_bpe_special_ids_and_sentinels(bpe_files):
    vocab = json.load(open(bpe_files[0], encoding="utf-8"))
    tokenizer = build_tokenizer("GPT2BPETokenizer", *bpe_files, vocab_extra_ids=3)
    assert tokenizer.eod == tokenizer.eos == tokenizer.pad == vocab["<|endoftext|>"]
    assert tokenizer.vocab_size == len(vocab) + 3
    assert tokenizer.sentinel_ids == [len(vocab), len(vocab) + 1, len(vocab) + 2]
    ids = [tokenizer.sentinel_ids[0]] + tokenizer.tokenize("hi there") + [tokenizer.sentinel_ids[2]]
    assert tokenizer.detokenize(ids) == "<extra_id_0>hi there<extra_id_2>"
    assert build_tokenizer("GPT2BPETokenizer", *bpe_files).sentinel_ids == []
    with pytest.raises(ValueError, match="out of range"):
        tokenizer.detokenize([tokenizer.vocab_size])


def test_env_var_forces_python_backend(bpe_files, monkeypatch):
    monkeypatch.setenv("MEGATRON_BPE_BACKEND", "python")
    assert build_tokenizer("GPT2BPETokenizer", *bpe_files).backend == "python"


def test_bpe_rejects_bad_vocab(bpe_files, tmp_path):
    vocab = json.load(open(bpe_files[0], encoding="utf-8"))
    no_eod = {k: v for k, v in vocab.items() if k != "<|endoftext|>"}
    (tmp_path / "no_eod.json").write_text(json.dumps(no_eod))
    with pytest.raises(ValueError, match=r"no_eod\.json: no <\|endoftext\|>"):
        GPT2BPETokenizer(str(tmp_path / "no_eod.json"), bpe_files[1])
    not_bytes = {k: v for k, v in vocab.items() if k != "!"}
    (tmp_path / "not_bytes.json").write_text(json.dumps(not_bytes))
    with pytest.raises(ValueError, match="not a byte-level BPE vocab"):
        GPT2BPETokenizer(str(tmp_path / "not_bytes.json"), bpe_files[1])
    holes = dict(vocab, **{"<|endoftext|>": len(vocab) + 3})  # ids no longer 0..N-1
    (tmp_path / "holes.json").write_text(json.dumps(holes))
    with pytest.raises(ValueError, match=r"holes\.json: the ids of its \d+ tokens are not 0\.\.\d+ once each"):
        GPT2BPETokenizer(str(tmp_path / "holes.json"), bpe_files[1])


@pytest.mark.parametrize("content", ["", "#version: 0.2\n", "\n\n"])
def test_bpe_refuses_a_merges_file_without_merges(bpe_files, tmp_path, content):
    """Every text would be encoded byte by byte: a file no user means."""
    (tmp_path / "merges.txt").write_text(content)
    with pytest.raises(ValueError, match=r"merges\.txt: no merges \(the file is empty or holds only its"):
        GPT2BPETokenizer(bpe_files[0], str(tmp_path / "merges.txt"))


def test_spm_ids_sentinels_and_round_trip(spm_model):
    import sentencepiece

    reference = sentencepiece.SentencePieceProcessor(model_file=spm_model)
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=spm_model, vocab_extra_ids=2)
    assert isinstance(tokenizer, SentencePieceTokenizer)
    assert (tokenizer.pad, tokenizer.eos, tokenizer.unk, tokenizer.eod) == (0, 1, 2, 1)
    pieces = reference.get_piece_size()
    assert tokenizer.vocab_size == pieces + 2 and tokenizer.sentinel_ids == [pieces, pieces + 1]
    for text in TEXTS:
        ids = tokenizer.tokenize(text)
        assert ids == reference.encode(text) and tokenizer.detokenize(ids) == text, text
    ids = tokenizer.tokenize("a b") + [tokenizer.sentinel_ids[1]]
    assert tokenizer.detokenize(ids) == "a b<extra_id_1>"


def test_build_tokenizer_errors(bpe_files, tmp_path):
    with pytest.raises(ValueError, match="unknown tokenizer type 'Bert'"):
        build_tokenizer("Bert")
    with pytest.raises(ValueError, match="needs --vocab-file and --merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=bpe_files[0])
    with pytest.raises(FileNotFoundError, match="missing.json"):
        build_tokenizer("GPT2BPETokenizer", str(tmp_path / "missing.json"), bpe_files[1])
    with pytest.raises(FileNotFoundError, match="nope.model"):
        build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "nope.model"))
