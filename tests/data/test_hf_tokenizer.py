"""HuggingFaceTokenizer: tokenizer.json files made here (nothing downloaded) against transformers' own loader,
through tools/preprocess_data.py, and every bad file as one `error:` line naming it."""
import json
import os
import subprocess
import sys

import pytest

from megatron.errors import UserError
from megatron.tokenizer import HuggingFaceTokenizer, build_tokenizer
from harness.corpus import make_corpus, make_hf_bpe, make_llama_like, make_texts
from tests.data.test_tokenizer import TEXTS
from tools import preprocess_data, train_tokenizer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return make_hf_bpe(str(tmp_path_factory.mktemp("hf")), vocab_size=500)


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return make_llama_like(str(tmp_path_factory.mktemp("llama")))


def test_round_trip_and_special_ids(hf_dir):
    """train_tokenizer --type hf-bpe: eos = eod = pad = <|endoftext|> (id 0, named by tokenizer_config.json)."""
    for model in (hf_dir, os.path.join(hf_dir, "tokenizer.json")):
        tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=model)
        specials = (tokenizer.vocab_size, tokenizer.eos, tokenizer.eod, tokenizer.pad, tokenizer.bos)
        assert specials == (500, 0, 0, 0, None)
        assert tokenizer.sentinel_ids == []
        for text in TEXTS:
            assert tokenizer.detokenize(tokenizer.tokenize(text)) == text, text


def test_hf_bpe_matches_gpt2_bpe_on_the_same_corpus(hf_dir, tmp_path):
    """The tokenizer.json and vocab.json + merges.txt of the same training give the same ids."""
    corpus = make_corpus(str(tmp_path))
    vocab, merges = train_tokenizer.main(["--input", corpus, "--type", "bpe", "--vocab-size", "500",
                                          "--output-dir", str(tmp_path / "bpe")])
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab, merges)
    hf = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir)
    for text in TEXTS:
        if "<|endoftext|>" not in text:  # GPT2BPETokenizer never reads special tokens out of text
            assert hf.tokenize(text) == gpt2.tokenize(text), text


def test_llama_like_ids_match_transformers(llama_dir, monkeypatch):
    """A BOS-adding TemplateProcessing post-processor: the ids, specials and size transformers gives."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    ours = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=llama_dir)
    fast = PreTrainedTokenizerFast(tokenizer_file=os.path.join(llama_dir, "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(llama_dir)
    texts = TEXTS + make_texts(20, seed=3) + ["a<|end_of_text|>b", "x" * 50]
    for text in texts:
        ids = ours.tokenize(text)
        assert ids == fast.encode(text) == auto.encode(text), text
        assert ours.detokenize(ids) == fast.decode(ids), text
    assert len(ours.tokenize("x " * 50)) > 8  # tokenizer.json's truncation (8) is not applied
    assert (ours.bos, ours.eos, ours.eod, ours.pad) == (auto.bos_token_id, auto.eos_token_id, auto.eos_token_id,
                                                          auto.eos_token_id)
    assert ours.eos == 501 and ours.tokenize("")[0] == ours.bos == 500 and 501 in ours.tokenize("a<|end_of_text|>b")
    assert ours.vocab_size == len(auto) == 503


@pytest.mark.parametrize("specials,config,eos,bos", [
    (["<|end_of_text|>", "<|begin_of_text|>"], None, "<|end_of_text|>", "<|begin_of_text|>"),  # Llama-3
    (["<s>", "</s>", "<unk>"], None, "</s>", "<s>"),  # Llama-2
    (["<bos>", "<eos>", "<pad>"], None, "<eos>", "<bos>"),  # Gemma without its config: pad falls back to eos
    (["<|im_end|>", "<|endoftext|>"], None, "<|endoftext|>", None),  # Qwen2 without its config
    (["<|im_end|>"], {"eos_token": {"content": "<|im_end|>", "special": True}}, "<|im_end|>", None),  # AddedToken form
    (["</s>", "<pad>"], {"eos_token": "</s>", "pad_token": "<pad>"}, "</s>", None),
])
def test_special_tokens_from_configs_or_names(tmp_path, specials, config, eos, bos):
    """special_tokens_map.json names the tokens; without it, the well-known names in the vocabulary."""
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()  # no special tokens of its own
    tokenizer.train_from_iterator(make_texts(30), vocab_size=300, show_progress=False)
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    if config is not None:
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(config))
    ours = HuggingFaceTokenizer(str(tmp_path))
    assert ours.eos == tokenizer.token_to_id(eos) and ours.bos == (bos and tokenizer.token_to_id(bos))
    assert ours.pad == tokenizer.token_to_id((config or {}).get("pad_token", eos))


def test_no_eos_is_refused(tmp_path):
    from tokenizers import ByteLevelBPETokenizer

    tokenizer = ByteLevelBPETokenizer()
    tokenizer.train_from_iterator(make_texts(30), vocab_size=300, show_progress=False)
    tokenizer.save(str(tmp_path / "tokenizer.json"))
    with pytest.raises(UserError, match=r"tokenizer\.json: no end-of-sequence token: none of <\|endoftext\|>"):
        HuggingFaceTokenizer(str(tmp_path))


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_appends_eos(tmp_path, llama_dir, workers):
    """--append-eod appends the eos; the BOS the post-processor adds stays; an empty text is an empty document."""
    rows = [{"text": t} for t in make_texts(60)] + [{"text": ""}]
    corpus = tmp_path / "c.jsonl"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    stats = preprocess_data.main(["--input", str(corpus), "--output-prefix", str(tmp_path / "o"), "--append-eod",
                                  "--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", llama_dir,
                                  "--workers", str(workers)])
    from megatron.data.indexed_dataset import MMapIndexedDataset
    ds = MMapIndexedDataset(str(tmp_path / "o_text_document"))
    tokenizer = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=llama_dir)
    assert [ds[i].tolist() for i in range(len(ds))] == [tokenizer.tokenize(t) + [501] for t in make_texts(60)]
    assert ds[0].tolist()[0] == 500 and stats.empty == 1


def test_training_arguments_take_it(tmp_path, llama_dir):
    """pretrain_gpt2.py's flags and its pre-launch check (megatron.config.preflight) accept the folder."""
    from megatron.config import preflight

    corpus = make_corpus(str(tmp_path))
    preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "d"), "--tokenizer-type",
                          "HuggingFaceTokenizer", "--tokenizer-model", llama_dir])
    preflight.main(["gpt", "--world-size", "1", "--num-layers", "1", "--hidden-size", "8", "--num-attention-heads",
                    "2", "--seq-length", "8", "--micro-batch-size", "1", "--train-iters", "1", "--data-path",
                    str(tmp_path / "d_text_document"), "--tokenizer-type", "HuggingFaceTokenizer",
                    "--tokenizer-model", llama_dir])


def test_extra_ids_refused(hf_dir):
    with pytest.raises(UserError, match="--vocab-extra-ids 100 with HuggingFaceTokenizer"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_dir, vocab_extra_ids=100)


def test_inference_loading_accepts_the_folder(hf_dir):
    """tools/generate.py and tools/evaluate.py build a checkpoint's tokenizer through this function."""
    from megatron.inference.loading import build_tokenizer_from

    saved = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": hf_dir, "vocab_size": 500}
    assert build_tokenizer_from(saved, {}, "ckpt").eod == 0
    with pytest.raises(UserError, match="trained with a vocabulary of 400"):
        build_tokenizer_from({**saved, "vocab_size": 400}, {}, "ckpt")


def _template_without_its_token(path):
    tokenizer = json.load(open(os.path.join(path, "tokenizer.json"), encoding="utf-8"))
    tokenizer["post_processor"] = {"type": "TemplateProcessing", "single": [
        {"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [], "special_tokens": {}}
    return json.dumps(tokenizer)


def _id_hole(path):
    tokenizer = json.load(open(os.path.join(path, "tokenizer.json"), encoding="utf-8"))
    vocab = tokenizer["model"]["vocab"]
    vocab[next(iter(vocab))] = len(vocab) + 5  # ids no longer 0..N-1: a hole, and one past the table
    return json.dumps(tokenizer)


BAD_FILES = [  # (file name, its content (or a function of make_hf_bpe's folder), config, the message's words)
    ("tokenizer.json", "{not json", None, "not a tokenizer.json: not JSON (line 1 column 2"),
    ("tokenizer.json", b"\xff\xfe", None, "not UTF-8 text"),
    ("tokenizer.json", "[1, 2]", None, "a JSON list, expected an object"),
    ("tokenizer.json", '{"vocab": {}}', None, "no 'model' object (keys: vocab)"),
    ("tokenizer.json", '{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}}', None,
     "not a tokenizer the tokenizers library can load: Token `b` out of vocabulary"),
    ("tokenizer.json", _template_without_its_token, None, "template writes '<s>', which its special_tokens"),
    ("tokenizer.json", _id_hole, None, "tokens and added tokens are not 0..N-1 once each"),
    ("tokenizer.json", lambda d: open(os.path.join(d, "tokenizer.json")).read(), "{oops", "not JSON"),
    ("tokenizer.json", lambda d: open(os.path.join(d, "tokenizer.json")).read(), '{"eos_token": "<nope>"}',
     "eos_token '<nope>' is not in the tokenizer's vocabulary"),
    ("vocab.json", "{}", None, "the folder holds no tokenizer.json (files: vocab.json)"),
]


def _bad_folder(tmp_path, hf_dir, case):
    name, content, config, _ = case
    folder = tmp_path / "bad"
    folder.mkdir()
    content = content(hf_dir) if callable(content) else content
    (folder / name).write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(config)
    return folder


@pytest.mark.parametrize("case", BAD_FILES, ids=[c[3][:30] for c in BAD_FILES])
def test_bad_files_are_one_line_naming_the_file(tmp_path, hf_dir, case):
    folder = _bad_folder(tmp_path, hf_dir, case)
    with pytest.raises(UserError) as info:
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(folder))
    message = str(info.value)
    assert case[3] in message and str(folder) in message and "\n" not in message, message


@pytest.mark.parametrize("case", [BAD_FILES[0], BAD_FILES[5], BAD_FILES[9]], ids=["not-json", "panic", "no-file"])
def test_bad_files_exit_2_from_the_tools(tmp_path, hf_dir, case):
    """Subprocesses: preprocess_data.py and the training preflight print one `error:` line, exit 2."""
    folder = _bad_folder(tmp_path, hf_dir, case)
    corpus = make_corpus(str(tmp_path))
    tok = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(folder)]
    good = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", hf_dir]
    preprocess_data.main(["--input", corpus, "--output-prefix", str(tmp_path / "d"), *good])
    runs = [[sys.executable, "tools/preprocess_data.py", "--input", corpus, "--output-prefix", str(tmp_path / "o"),
             *tok],
            [sys.executable, "-m", "megatron.config.preflight", "gpt", "--world-size", "1", "--num-layers", "1",
             "--hidden-size", "8", "--num-attention-heads", "2", "--seq-length", "8", "--micro-batch-size", "1",
             "--train-iters", "1", "--data-path", str(tmp_path / "d_text_document"), *tok]]
    for argv in runs:
        proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and proc.stderr.startswith("error: "), proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and str(folder) in proc.stderr, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["bad", "corpus.jsonl", "d_text_document.bin", "d_text_document.crc.json",
                                       "d_text_document.idx"]


def test_missing_tokenizer_model(tmp_path):
    with pytest.raises(UserError, match="HuggingFaceTokenizer needs --tokenizer-model tokenizer.json"):
        build_tokenizer("HuggingFaceTokenizer")
    with pytest.raises(UserError, match=r"--tokenizer-model .*nope\.json: file not found"):
        build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path / "nope.json"))
