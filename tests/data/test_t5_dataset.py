"""T5 span corruption: exact reconstruction, noise density, determinism, padding and masks."""
import numpy as np
import pytest

from megatron.data import t5_dataset as t5
from megatron.data.indexed_dataset import MMapIndexedDataset
from megatron.tokenizer import build_tokenizer
from harness.corpus import make_corpus, make_spm
from tests.data.test_gpt_dataset import unique_token_docs, write_dataset
from tools import preprocess_data


class FakeTokenizer:
    pad, eos = 0, 1
    sentinel_ids = list(range(100000, 100100))


def reconstruct(encoder, targets, sentinel_ids, eos):
    """Raw window from encoder input and targets: each sentinel in the input is replaced by its span."""
    sentinels = set(sentinel_ids)
    assert encoder[-1] == eos and targets[-1] == eos
    spans, current = {}, None
    for tok in targets[:-1]:
        if tok in sentinels:
            current = tok
            spans[current] = []
        else:
            spans[current].append(tok)
    out = []
    for tok in encoder[:-1]:
        out.extend(spans.pop(tok) if tok in sentinels else [tok])
    assert not spans  # every target span was used once
    return np.array(out)


def make_t5(tmp_path, n_docs=60, num_samples=200, enc=64, dec=24, seed=11, density=0.15, span=3.0):
    prefix = str(tmp_path / "corpus")
    sizes = np.random.RandomState(0).randint(5, 80, size=n_docs)
    indexed = write_dataset(prefix, unique_token_docs(sizes))
    return t5.T5Dataset("train", prefix, np.arange(n_docs, dtype=np.int32), indexed, num_samples,
                        FakeTokenizer(), enc, dec, seed, density, span)


@pytest.mark.parametrize("enc, dec, expected", [
    (512, 114, (568, 512, 114)),   # T5's standard pair (inputs 512 -> 568 raw tokens, targets 114)
    (512, 100, (496, 448, 100)),   # decoder too short: the window shrinks until the targets fit
    (64, 24, (70, 64, 14)),      # 71 raw tokens would give 65 encoder tokens
])
def test_t5_lengths(enc, dec, expected):
    assert t5.t5_lengths(enc, dec, 0.15, 3.0) == expected


def test_noise_mask_shape():
    rng = np.random.default_rng(0)
    for length in (10, 71, 568):
        mask = t5.random_spans_noise_mask(length, 0.15, 3.0, rng)
        noise, spans = t5._noise_and_spans(length, 0.15, 3.0)
        starts = mask & ~np.concatenate(([False], mask[:-1]))
        assert mask.sum() == noise and starts.sum() == spans and not mask[0] and mask[-1]


def test_span_corrupt_example():
    tokens = np.array([10, 11, 12, 13, 14, 15, 16, 17])
    mask = np.array([0, 0, 1, 1, 0, 0, 0, 1], dtype=bool)
    encoder, targets = t5.span_corrupt(tokens, mask, [900, 901], eos=1)
    assert encoder.tolist() == [10, 11, 900, 14, 15, 16, 901, 1]
    assert targets.tolist() == [900, 12, 13, 901, 17, 1]


def test_reconstruction_is_exact(tmp_path):
    ds = make_t5(tmp_path)
    assert ds.raw_length == 70
    for i in range(0, len(ds), 7):
        tokens, encoder, targets = ds.corrupt(i)
        assert len(tokens) == ds.raw_length and len(encoder) <= 64 and len(targets) <= 24
        np.testing.assert_array_equal(reconstruct(encoder.tolist(), targets.tolist(),
                                                  FakeTokenizer.sentinel_ids, 1), tokens)


@pytest.mark.parametrize("density, span", [(0.15, 3.0), (0.3, 5.0)])
def test_noise_density(tmp_path, density, span):
    ds = make_t5(tmp_path, enc=200, dec=120, density=density, span=span)
    noise = total = 0
    for i in range(100):
        tokens, _, targets = ds.corrupt(i)
        noise += np.sum(~np.isin(targets, FakeTokenizer.sentinel_ids)) - 1  # minus eos
        total += len(tokens)
    assert abs(noise / total - density) <= 0.02 * density


def test_deterministic_across_calls_and_instances(tmp_path):
    ds = make_t5(tmp_path)
    again = make_t5(tmp_path)  # loads the cached window index
    other_seed = make_t5(tmp_path, seed=12)
    for i in (0, 5, 99):
        a, b = ds[i], again[i]
        assert all(np.array_equal(a[k], b[k]) for k in a)
        assert np.array_equal(a["text_enc"], ds[i]["text_enc"])
    assert any(not np.array_equal(ds[i]["text_enc"], other_seed[i]["text_enc"]) for i in range(5))


def test_padding_and_masks(tmp_path):
    ds = make_t5(tmp_path, enc=66, dec=15)  # window 72 needs 16 targets; 70 -> encoder 64 of 66, targets 14 of 15
    s = ds[3]
    _, encoder, targets = ds.corrupt(3)
    assert ds.raw_length == 70
    n_enc, n_dec = len(encoder), len(targets)
    assert {k: v.shape for k, v in s.items()} == {
        "text_enc": (66,), "text_dec": (15,), "labels": (15,), "loss_mask": (15,),
        "enc_mask": (66, 66), "dec_mask": (15, 15), "enc_dec_mask": (15, 66)}
    assert s["text_enc"].dtype == np.int64 and s["enc_mask"].dtype == bool
    assert s["text_enc"][:n_enc].tolist() == encoder.tolist() and (s["text_enc"][n_enc:] == 0).all()
    assert s["labels"][:n_dec].tolist() == targets.tolist() and (s["labels"][n_dec:] == 0).all()
    assert s["text_dec"].tolist() == [0] + targets[:-1].tolist() + [0] * (15 - n_dec)
    assert s["loss_mask"].tolist() == [1.0] * n_dec + [0.0] * (15 - n_dec)
    key_pad = np.arange(66) >= n_enc
    assert (s["enc_mask"] == key_pad[None, :]).all() and (s["enc_dec_mask"] == key_pad[None, :]).all()
    q, k = np.meshgrid(np.arange(15), np.arange(15), indexing="ij")
    assert (s["dec_mask"] == ((k > q) | (k >= n_dec))).all()


def test_too_few_sentinels(tmp_path):
    class Few(FakeTokenizer):
        sentinel_ids = [100000, 100001]
    prefix = str(tmp_path / "c")
    indexed = write_dataset(prefix, [np.arange(500)])
    with pytest.raises(ValueError, match="2 sentinels"):
        t5.T5Dataset("train", prefix, np.arange(1, dtype=np.int32), indexed, 5, Few(), 64, 24, 1)


def test_end_to_end_with_spm_and_preprocess(tmp_path):
    model = make_spm(str(tmp_path), 600)
    tokenizer = build_tokenizer("SentencePieceTokenizer", tokenizer_model=model, vocab_extra_ids=100)
    preprocess_data.main(["--input", make_corpus(str(tmp_path)), "--output-prefix", str(tmp_path / "t5"),
                          "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model,
                          "--vocab-extra-ids", "100", "--append-eod"])
    prefix = str(tmp_path / "t5_text_document")
    train, valid, test = t5.build_t5_datasets([prefix], "90,10,0", [40, 8, 0], 128, 40, 3, tokenizer)
    assert test is None and len(train) >= 40 and len(valid) >= 8
    windows = MMapIndexedDataset(prefix)
    source = set(np.concatenate([windows[i] for i in range(len(windows))]).tolist())
    for i in range(8):
        tokens, encoder, targets = valid.corrupt(i)
        assert set(tokens.tolist()) <= source
        assert encoder[0] not in tokenizer.sentinel_ids and targets[0] == tokenizer.sentinel_ids[0]
        np.testing.assert_array_equal(
            reconstruct(encoder.tolist(), targets.tolist(), tokenizer.sentinel_ids, tokenizer.eos), tokens)
        assert "<extra_id_0>" in tokenizer.detokenize(train[i]["text_enc"].tolist())
