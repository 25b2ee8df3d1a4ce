"""Hugging Face transformers export and import through the command line (transformers is a test dependency).

- export-hf of the (2, 2, 2) GPT-2 and T5 checkpoints: transformers loads the folder and gives the logits of
  this project's model (tp = 1, loaded with load_model_weights) on random ids (fp32, rel err < 1e-5; T5 with
  encoder and decoder ids); AutoTokenizer loads the tokenizer files and encodes a test string to this
  project's ids, sentinels included;
- import-hf then export-hf reproduces the HF weights exactly, shapes and config.json's vocab_size included:
  GPT-2 (BPE), T5 v1.0 with a sentencepiece tokenizer (sentinel rows reordered on the way in and back on the
  way out), T5 v1.1 (gated GELU, untied head, decoder deeper than the encoder); T5 folders shaped as the hub
  ships t5-small (spiece.model + tokenizer.json, no tokenizer_config.json: T5Tokenizer's 100 sentinels, and
  28 padding rows after them), whose sentinel rows this project's tokenizer then indexes; GPT-2 and T5
  folders without tokenizer files (exported without them, saying so);
- training continues from an imported GPT-2 at (2, 2, 1), and from an imported hub-shaped T5 with its
  sentencepiece model and 100 sentinels (span corruption): the first loss is the HF model's loss on that batch;
- an HF config with options the model does not implement, a tokenizer with more ids than the table has rows
  and sentinels numbered unlike T5Tokenizer are refused in one line naming them.
"""
import json
import os
import shutil

import numpy as np
import pytest
import torch

from megatron.checkpointing import read_checkpoint_args
from megatron.errors import UserError
from tests.checkpoint.common import argv, first_iteration_batches, mean_loss, train
from harness.dist import run_distributed
from tests.training.golden_cases import DATA
from tools.convert_checkpoint import run

transformers = pytest.importorskip("transformers")
RTOL = 1e-5
TEXT = "Hello world, this is a test of the tokenizer: def f(x): return x ** 2  # done\n\tünïcödé"


def _our_model(load_dir: str):
    from megatron.checkpointing import load_model_weights
    from megatron.checkpointing.names import model_config
    from megatron.model import GPT2Model, T5Model
    saved = read_checkpoint_args(load_dir)
    model = (GPT2Model if saved["model_type"] == "gpt" else T5Model)(model_config(saved))
    load_model_weights(model, load_dir)
    return model.eval(), saved


@pytest.mark.parametrize("kind", ["gpt2", pytest.param("t5", marks=pytest.mark.long)])
def test_export_matches_transformers(kind, request, tmp_path, capsys):
    ckpt = request.getfixturevalue(f"{kind}_222")["dir"]
    out = str(tmp_path / "hf")
    run(["export-hf", "--load", ckpt, "--output", out, "--verify"])
    assert "verified with transformers" in capsys.readouterr().out
    ours, saved = _our_model(ckpt)
    vocab, g = saved["vocab_size"], torch.Generator().manual_seed(1)
    ids = torch.randint(0, vocab, (3, 20), generator=g)
    with torch.no_grad():
        if kind == "gpt2":
            mine = ours(ids)
            theirs = transformers.AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=ids).logits
        else:
            dec = torch.randint(0, vocab, (3, 9), generator=g)
            causal = torch.triu(torch.ones(9, 9, dtype=torch.bool), 1).expand(3, 1, 9, 9)
            mine = ours(ids, dec, torch.zeros(3, 1, 20, 20, dtype=torch.bool), causal,
                        torch.zeros(3, 1, 9, 20, dtype=torch.bool))
            hf = transformers.AutoModelForSeq2SeqLM.from_pretrained(out).eval()
            theirs = hf(input_ids=ids, decoder_input_ids=dec).logits
    mine = mine[..., :vocab]
    assert theirs.shape == mine.shape
    torch.testing.assert_close(theirs, mine, rtol=RTOL, atol=RTOL * mine.abs().max().item())
    from megatron.tokenizer import build_tokenizer
    tokenizer = build_tokenizer(saved["tokenizer_type"], saved["vocab_file"], saved["merge_file"],
                                saved["tokenizer_model"], saved["vocab_extra_ids"])
    hf_tok = transformers.AutoTokenizer.from_pretrained(out)
    assert hf_tok.encode(TEXT, add_special_tokens=False) == tokenizer.tokenize(TEXT)
    for i, sentinel in enumerate(tokenizer.sentinel_ids):
        assert hf_tok.convert_tokens_to_ids(f"<extra_id_{i}>") == sentinel
    assert not os.path.exists(os.path.join(os.path.dirname(ckpt), "hf"))


def _save_hf(model, folder: str, tokenizer_files: dict, tokenizer_config) -> str:
    """model.save_pretrained(folder), the tokenizer files copied in, tokenizer_config.json unless None."""
    model.save_pretrained(folder)
    for name, src in tokenizer_files.items():
        shutil.copyfile(src, os.path.join(folder, name))
    if tokenizer_config is not None:
        with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
            json.dump(tokenizer_config, f)
    return folder


def _hf_gpt2(tmp_path, tokenizer: str = "bpe") -> str:
    """tokenizer 'bpe': the test vocabulary's vocab.json, merges.txt and tokenizer_config.json; 'none': the
    model's save_pretrained alone."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                                     eos_token_id=0)
    files = {"vocab.json": os.path.join(DATA, "vocab.json"), "merges.txt": os.path.join(DATA, "merges.txt")}
    return _save_hf(transformers.GPT2LMHeadModel(config), str(tmp_path / "hf_gpt2"),
                    *((files, {"tokenizer_class": "GPT2Tokenizer"}) if tokenizer == "bpe" else ({}, None)))


HUB_SENTINELS, HUB_PADDING = 100, 28  # t5-small: 32128 rows = 32000 pieces + 100 sentinels + 28 padding rows


def _hf_t5(tmp_path, v11: bool, tokenizer: str = "config") -> str:
    """A T5 folder (v1.1: gated GELU, untied head, deeper decoder) with a test sentencepiece model. tokenizer
    'config': spiece.model + tokenizer_config.json with 8 extra_ids, table = pieces + 8 rows; 'hub': as the
    hub ships t5-small, spiece.model + tokenizer.json (written by transformers' T5Tokenizer, 100 sentinels)
    and no tokenizer_config.json, table = pieces + 100 + 28 padding rows; 'none': save_pretrained alone."""
    from harness.corpus import make_spm
    import sentencepiece
    (tmp_path / "spm").mkdir()
    spm = make_spm(str(tmp_path / "spm"), vocab_size=600)
    pieces = sentencepiece.SentencePieceProcessor(model_file=spm).get_piece_size()
    rows = pieces + (8 if tokenizer == "config" else HUB_SENTINELS + HUB_PADDING)
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=rows, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_decoder_layers=3 if v11 else 2, num_heads=4,
                                   feed_forward_proj="gated-gelu" if v11 else "relu", tie_word_embeddings=not v11,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = transformers.T5ForConditionalGeneration(config)
    if v11:  # a head of its own (transformers >= 5 builds T5 v1.1 with the head tied to the table)
        model.lm_head.weight = torch.nn.Parameter(torch.randn(rows, 32))
    folder = str(tmp_path / f"hf_t5_{'v11' if v11 else 'v10'}")
    if tokenizer == "config":
        return _save_hf(model, folder, {"spiece.model": spm}, {"tokenizer_class": "T5Tokenizer", "extra_ids": 8})
    if tokenizer == "none":
        return _save_hf(model, folder, {}, None)
    (tmp_path / "tok").mkdir()
    shutil.copyfile(spm, str(tmp_path / "tok" / "spiece.model"))
    transformers.T5Tokenizer.from_pretrained(str(tmp_path / "tok")).save_pretrained(str(tmp_path / "tok"))
    return _save_hf(model, folder, {"spiece.model": spm, "tokenizer.json": str(tmp_path / "tok" / "tokenizer.json")},
                    None)


def _hf_folder(tmp_path, kind: str, tokenizer: str) -> str:
    return _hf_gpt2(tmp_path, tokenizer) if kind == "gpt2" else _hf_t5(tmp_path, kind == "t5_v11", tokenizer)


@pytest.mark.parametrize("kind, tokenizer", [("gpt2", "bpe"), ("t5_v10", "config"), ("t5_v11", "config"),
                                             ("t5_v10", "hub"), ("t5_v11", "hub"),
                                             ("gpt2", "none"), ("t5_v10", "none"), ("t5_v11", "none")])
def test_import_then_export_reproduces_hf_weights(kind, tokenizer, tmp_path, capsys):
    from safetensors.torch import load_file
    hf_dir = _hf_folder(tmp_path, kind, tokenizer)
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    run(["import-hf", "--input", hf_dir, "--save", ckpt, "--tensor-model-parallel-size", "2",
         "--pipe-parallel-size", "2"])
    saved = read_checkpoint_args(ckpt)
    assert (saved["tensor_model_parallel_size"], saved["pipe_parallel_size"]) == (2, 2)
    assert saved["checkpoint_content"] == "weights"
    assert tokenizer == "none" or os.path.isfile(saved["vocab_file"] or saved["tokenizer_model"])
    run(["export-hf", "--load", ckpt, "--output", back, "--verify"])
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = load_file(os.path.join(back, "model.safetensors"))
    if "lm_head.weight" in exported and "lm_head.weight" not in original:  # tied in the file transformers wrote
        assert torch.equal(exported.pop("lm_head.weight"), original["shared.weight"])
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    out = capsys.readouterr().out
    assert "verified with transformers" in out
    configs = [transformers.AutoConfig.from_pretrained(d) for d in (hf_dir, back)]
    assert configs[1].vocab_size == configs[0].vocab_size
    if tokenizer == "none":
        assert sorted(os.listdir(back)) == ["config.json", "generation_config.json", "model.safetensors"]
        assert "tokenizer: none in" in out and "no tokenizer files written" in out
        with pytest.raises(UserError, match="--tokenizer-model replaces a file of the checkpoint's tokenizer, but "
                                            "the checkpoint records none"):
            run(["export-hf", "--load", ckpt, "--output", str(tmp_path / "x"), "--tokenizer-model", hf_dir])
        assert saved["vocab_size"] == configs[0].vocab_size
        keys = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
        assert [getattr(configs[1], k, None) for k in keys] == [getattr(configs[0], k, None) for k in keys]
    elif kind != "gpt2":  # T5Tokenizer's <extra_id_0> is the last id: it must still index the same row
        hf_tok = transformers.AutoTokenizer.from_pretrained(back)
        from megatron.tokenizer import build_tokenizer
        ours = build_tokenizer("SentencePieceTokenizer", tokenizer_model=saved["tokenizer_model"],
                               vocab_extra_ids=saved["vocab_extra_ids"])
        text = "return the first item of the list"  # in-vocabulary, single spaces: see README on byte fallback
        assert hf_tok.encode(text, add_special_tokens=False) == ours.tokenize(text)
        assert hf_tok.convert_tokens_to_ids("<extra_id_0>") == ours.sentinel_ids[-1]


@pytest.mark.parametrize("v11", [False, True])
def test_hub_t5_sentinel_rows_at_our_tokenizer_ids(v11, tmp_path):
    """The hub-shaped folder as transformers reads it: each <extra_id_k> row of its table is the row this
    project's model (built from the import at tp = 1) holds at its tokenizer's id for <extra_id_k>."""
    from safetensors.torch import load_file
    from megatron.tokenizer import build_tokenizer
    hf_dir = _hf_t5(tmp_path, v11, "hub")
    ckpt = str(tmp_path / "ckpt")
    run(["import-hf", "--input", hf_dir, "--save", ckpt, "--tensor-model-parallel-size", "1",
         "--pipe-parallel-size", "1"])
    model, saved = _our_model(ckpt)
    hf_tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    ours = build_tokenizer(saved["tokenizer_type"], tokenizer_model=saved["tokenizer_model"],
                           vocab_extra_ids=saved["vocab_extra_ids"])
    assert len(ours.sentinel_ids) == HUB_SENTINELS and saved["vocab_size"] == len(hf_tok) == ours.vocab_size
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    tables = [("shared.weight", model.embedding.word_embeddings.weight)]
    if v11:
        tables.append(("lm_head.weight", model.lm_head.weight))
    for hf_name, table in tables:
        assert table.size(0) >= original[hf_name].size(0)  # every HF row kept
        for k, our_id in enumerate(ours.sentinel_ids):
            hf_id = hf_tok.convert_tokens_to_ids(f"<extra_id_{k}>")
            assert torch.equal(table[our_id], original[hf_name][hf_id]), (hf_name, k)


def hf_first_loss(hf_dir: str, args) -> float:
    """The HF causal LM's loss on iteration 1's micro-batches of pretrain_gpt2.py with `args` (causal data: the
    micro-batches carry tokens and positions only)."""
    batches = first_iteration_batches("gpt2", args)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    return mean_loss(lambda tokens, position_ids: model(input_ids=tokens).logits, batches)


def test_training_continues_from_imported_gpt2(tmp_path, data_prefix):
    hf_dir = _hf_gpt2(tmp_path)
    ckpt = str(tmp_path / "imported")
    run(["import-hf", "--input", hf_dir, "--save", ckpt, "--tensor-model-parallel-size", "2",
         "--pipe-parallel-size", "2"])
    extra = ["--load", ckpt, "--max-position-embeddings", "64"]
    losses = train("gpt2", data_prefix, (2, 2, 1), 2, extra)
    assert len(losses) == 2  # started at iteration 0
    reference = run_distributed(hf_first_loss, 1, hf_dir, argv("gpt2", data_prefix, 1, 1, 2, extra))[0]
    np.testing.assert_allclose(losses[0], reference, rtol=RTOL)


def _hf_t5_first_loss(hf_dir: str, args, order: list) -> float:
    """The HF model's loss on iteration 1's batches, ids mapped to its numbering and logits back (its padding
    rows left out, as this project masks them)."""
    batches = first_iteration_batches("t5", args)
    model = transformers.AutoModelForSeq2SeqLM.from_pretrained(hf_dir).eval()
    order = torch.tensor(order)

    def logits(enc, dec, enc_mask, dec_mask, cross_mask):  # masks: True = masked; padding is at the end
        keep = (~enc_mask[:, 0, 0, :]).long()  # (b, se): the first token's row is the key padding mask
        return model(input_ids=order[enc], attention_mask=keep, decoder_input_ids=order[dec]).logits[..., order]
    return mean_loss(logits, batches)


def test_training_continues_from_hub_t5(tmp_path):
    """pretrain_t5 from the import of a hub-shaped T5 with the imported sentencepiece model and its 100
    sentinels: span corruption puts sentinels in every sample, and the first loss is transformers' loss."""
    import subprocess
    import sys
    from megatron.checkpointing.hf.tokenizer_files import sentinel_order
    hf_dir, ckpt = _hf_t5(tmp_path, False, "hub"), str(tmp_path / "imported")
    run(["import-hf", "--input", hf_dir, "--save", ckpt, "--tensor-model-parallel-size", "1",
         "--pipe-parallel-size", "1"])
    saved = read_checkpoint_args(ckpt)
    prefix = str(tmp_path / "spm_data")
    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", str(tmp_path / "spm" / "corpus.jsonl"),
                    "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", saved["tokenizer_model"],
                    "--append-eod", "--output-prefix", prefix], check=True, stdout=subprocess.DEVNULL,
                   cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    extra = ["--load", ckpt, "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model",
             saved["tokenizer_model"], "--vocab-extra-ids", str(HUB_SENTINELS), "--kv-channels", "8",
             "--ffn-hidden-size", "64", "--make-vocab-size-divisible-by", "128"]
    data = prefix + "_text_document"
    losses = train("t5", data, (1, 1, 1), 2, extra)
    assert len(losses) == 2  # started at iteration 0
    order = sentinel_order(saved, saved["vocab_size"])
    reference = run_distributed(_hf_t5_first_loss, 1, hf_dir, argv("t5", data, 1, 1, 2, extra), order)[0]
    np.testing.assert_allclose(losses[0], reference, rtol=RTOL)


def test_tokenizer_not_matching_the_table_is_named(tmp_path):
    """T5Tokenizer's 100 default sentinels that the table has no rows for, and sentinels numbered other than
    T5Tokenizer numbers them, are one-line errors (rows would be dropped or sentinels swapped otherwise)."""
    hf_dir = _hf_t5(tmp_path, False, "hub")
    import_args = ["import-hf", "--input", hf_dir, "--save", str(tmp_path / "x"), "--tensor-model-parallel-size",
                   "1", "--pipe-parallel-size", "1"]
    config_path, tok_path = os.path.join(hf_dir, "config.json"), os.path.join(hf_dir, "tokenizer.json")
    with open(tok_path) as f:
        tok = json.load(f)
    pieces = next(t["id"] for t in tok["added_tokens"] if t["content"] == "<extra_id_99>")
    for t in tok["added_tokens"]:  # Megatron's numbering: <extra_id_k> = pieces + k
        if t["content"].startswith("<extra_id_"):
            t["id"] = pieces + int(t["content"][len("<extra_id_"):-1])
    with open(tok_path, "w") as f:
        json.dump(tok, f)
    with pytest.raises(UserError, match=f"<extra_id_0> has id {pieces}, .* T5Tokenizer numbers it {pieces + 99}"):
        run(import_args)
    os.remove(tok_path)  # spiece.model alone: T5Tokenizer's default of 100 sentinels
    with open(config_path) as f:
        config = json.load(f)
    config["vocab_size"] = pieces + 50
    with open(config_path, "w") as f:
        json.dump(config, f)
    with pytest.raises(UserError, match=f"vocab_size {pieces + 50} is smaller than the tokenizer's {pieces + 100} "
                                        f"ids \\({pieces} base ids \\+ 100 sentinels"):
        run(import_args)
    assert not os.path.exists(tmp_path / "x")


def test_unsupported_hf_options_are_named(tmp_path):
    hf_dir = _hf_gpt2(tmp_path)
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    config.update(activation_function="relu", scale_attn_by_inverse_layer_idx=True)
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(UserError, match="activation_function = relu; scale_attn_by_inverse_layer_idx = True"):
        run(["import-hf", "--input", hf_dir, "--save", str(tmp_path / "x"), "--tensor-model-parallel-size", "1",
             "--pipe-parallel-size", "1"])
    config.update(model_type="gemma")
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(UserError, match="import-hf handles model_type 'gpt2', 't5', 'llama', 'mistral', 'qwen2', "
                                        "'qwen3', 'olmo2', 'mixtral', 'qwen2_moe', 'qwen3_moe', 'olmoe'; "
                                        ".* has model_type 'gemma'"):
        run(["import-hf", "--input", hf_dir, "--save", str(tmp_path / "x"), "--tensor-model-parallel-size", "1",
             "--pipe-parallel-size", "1"])
    assert not os.path.exists(tmp_path / "x")


@pytest.mark.parametrize("key, words", [("n_positions", "transformer.wpe.weight has shape (64, 32)"),
                                        ("n_embd", "transformer.wte.weight has shape")])
def test_a_shape_field_missing_from_config_json_is_named(tmp_path, key, words):
    """config.json without a shape field (renamed, as a flipped bit renames it: n_positions -> n|positions):
    import-hf would take transformers' default (1024 positions, hidden 768) for weights of another shape; it
    refuses, naming config.json and the tensor, as transformers' from_pretrained refuses the size mismatch."""
    hf_dir = _hf_gpt2(tmp_path)
    path = os.path.join(hf_dir, "config.json")
    with open(path) as f:
        config = json.load(f)
    config[key.replace("_", "|")] = config.pop(key)
    with open(path, "w") as f:
        json.dump(config, f)
    with pytest.raises(UserError) as err:
        run(["import-hf", "--input", hf_dir, "--save", str(tmp_path / "x"), "--tensor-model-parallel-size", "1",
             "--pipe-parallel-size", "1"])
    assert str(err.value).startswith(f"{path} does not match the weights: ") and words in str(err.value), err.value
    assert not os.path.exists(tmp_path / "x")
