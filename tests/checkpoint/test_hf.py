"""Hugging Face transformers export and import through the command line (transformers is a test dependency).

- export-hf of the (2, 2, 2) GPT-2 and T5 checkpoints: transformers loads the folder and gives the logits of
  this project's model (tp = 1, loaded with load_model_weights) on random ids (fp32, rel err < 1e-5; T5 with
  encoder and decoder ids); AutoTokenizer loads the tokenizer files and encodes a test string to this
  project's ids, sentinels included;
- import-hf then export-hf reproduces the HF weights exactly: GPT-2 (BPE), T5 v1.0 with a sentencepiece
  tokenizer (sentinel rows reordered on the way in and back on the way out), T5 v1.1 (gated GELU, untied
  head, decoder deeper than the encoder);
- training continues from an imported GPT-2 at (2, 2, 1): the first loss is the HF model's loss on that batch;
- an HF config with options the model does not implement is refused in one line naming them.
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
from tests.dist import run_distributed
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


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
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


def _save_hf(model, folder: str, tokenizer_files: dict, tokenizer_config: dict) -> str:
    model.save_pretrained(folder)
    for name, src in tokenizer_files.items():
        shutil.copyfile(src, os.path.join(folder, name))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config, f)
    return folder


def _hf_gpt2(tmp_path) -> str:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                                     eos_token_id=0)
    return _save_hf(transformers.GPT2LMHeadModel(config), str(tmp_path / "hf_gpt2"),
                    {"vocab.json": os.path.join(DATA, "vocab.json"), "merges.txt": os.path.join(DATA, "merges.txt")},
                    {"tokenizer_class": "GPT2Tokenizer"})


def _hf_t5(tmp_path, v11: bool) -> str:
    from tests.data.corpus import make_spm
    import sentencepiece
    (tmp_path / "spm").mkdir()
    spm = make_spm(str(tmp_path / "spm"), vocab_size=600)
    pieces, extra = sentencepiece.SentencePieceProcessor(model_file=spm).get_piece_size(), 8
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=pieces + extra, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_decoder_layers=3 if v11 else 2, num_heads=4,
                                   feed_forward_proj="gated-gelu" if v11 else "relu", tie_word_embeddings=not v11,
                                   decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    model = transformers.T5ForConditionalGeneration(config)
    if v11:  # a head of its own (transformers >= 5 builds T5 v1.1 with the head tied to the table)
        model.lm_head.weight = torch.nn.Parameter(torch.randn(pieces + extra, 32))
    return _save_hf(model, str(tmp_path / f"hf_t5_{'v11' if v11 else 'v10'}"), {"spiece.model": spm},
                    {"tokenizer_class": "T5Tokenizer", "extra_ids": extra})


@pytest.mark.parametrize("kind", ["gpt2", "t5_v10", "t5_v11"])
def test_import_then_export_reproduces_hf_weights(kind, tmp_path):
    from safetensors.torch import load_file
    hf_dir = _hf_gpt2(tmp_path) if kind == "gpt2" else _hf_t5(tmp_path, kind == "t5_v11")
    ckpt, back = str(tmp_path / "ckpt"), str(tmp_path / "back")
    run(["import-hf", "--input", hf_dir, "--save", ckpt, "--tensor-model-parallel-size", "2",
         "--pipe-parallel-size", "2"])
    saved = read_checkpoint_args(ckpt)
    assert (saved["tensor_model_parallel_size"], saved["pipe_parallel_size"]) == (2, 2)
    assert saved["checkpoint_content"] == "weights" and os.path.isfile(saved["vocab_file"] or saved["tokenizer_model"])
    run(["export-hf", "--load", ckpt, "--output", back])
    original = load_file(os.path.join(hf_dir, "model.safetensors"))
    exported = load_file(os.path.join(back, "model.safetensors"))
    if "lm_head.weight" in exported and "lm_head.weight" not in original:  # tied in the file transformers wrote
        assert torch.equal(exported.pop("lm_head.weight"), original["shared.weight"])
    assert sorted(exported) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(exported[name], tensor), name
    if kind != "gpt2":  # T5Tokenizer's <extra_id_0> is the last id: it must still index the same row
        hf_tok = transformers.AutoTokenizer.from_pretrained(back)
        from megatron.tokenizer import build_tokenizer
        ours = build_tokenizer("SentencePieceTokenizer", tokenizer_model=saved["tokenizer_model"], vocab_extra_ids=8)
        text = "return the first item of the list"  # in-vocabulary, single spaces: see README on byte fallback
        assert hf_tok.encode(text, add_special_tokens=False) == ours.tokenize(text)
        assert hf_tok.convert_tokens_to_ids("<extra_id_0>") == ours.sentinel_ids[-1]


def _hf_first_loss(hf_dir: str, args) -> float:
    batches = first_iteration_batches("gpt2", args)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    return mean_loss(lambda tokens, position_ids, mask: model(input_ids=tokens).logits, batches)


@pytest.mark.slow
def test_training_continues_from_imported_gpt2(tmp_path, data_prefix):
    hf_dir = _hf_gpt2(tmp_path)
    ckpt = str(tmp_path / "imported")
    run(["import-hf", "--input", hf_dir, "--save", ckpt, "--tensor-model-parallel-size", "2",
         "--pipe-parallel-size", "2"])
    extra = ["--load", ckpt, "--max-position-embeddings", "64"]
    losses = train("gpt2", data_prefix, (2, 2, 1), 2, extra)
    assert len(losses) == 2  # started at iteration 0
    reference = run_distributed(_hf_first_loss, 1, hf_dir, argv("gpt2", data_prefix, 1, 1, 2, extra))[0]
    np.testing.assert_allclose(losses[0], reference, rtol=RTOL)


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
    config.update(model_type="llama")
    with open(os.path.join(hf_dir, "config.json"), "w") as f:
        json.dump(config, f)
    with pytest.raises(UserError, match="import-hf handles model_type 'gpt2' and 't5'.*'llama'"):
        run(["import-hf", "--input", hf_dir, "--save", str(tmp_path / "x"), "--tensor-model-parallel-size", "1",
             "--pipe-parallel-size", "1"])
    assert not os.path.exists(tmp_path / "x")
