"""Greedy generation equals transformers' `generate(do_sample=False)`, token for token, on the same prompts.

The round trip is the conversion issue's: a small random transformers GPT-2 / Llama (grouped-query attention,
head_dim != hidden / heads, llama3 rope scaling, untied head) / T5 (v1.0, and v1.1 gated with an untied head)
with the test BPE tokenizer is imported with `tools/convert_checkpoint.py import-hf` at tp=2 (GPT-2, Llama) or
pp=2 (T5), generated from here at tp=1 (resharded on load), and exported back with `export-hf`;
transformers generates from the exported folder. Large initial weights make greedy text wander over the
vocabulary (a small-init model repeats one token and would hide position or cache mistakes). Prompt by
prompt and, for GPT-2, as one left-padded batch. Skipped only when transformers is not installed."""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from tests.inference import common

transformers = pytest.importorskip("transformers")

NEW = 12
SENTINELS = 8
PROMPTS = {"gpt2": common.PROMPTS, "t5": ["The <extra_id_0> parallel pipeline <extra_id_1> gradient", "data",
                                          "The model <extra_id_7>"]}


def _hf_model(kind: str):
    """A random transformers model over the test BPE vocabulary (512 ids, <|endoftext|> = 0)."""
    torch.manual_seed(0)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=512, n_positions=48, n_embd=32, n_layer=2, n_head=4,
                                         initializer_range=1.0, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        return transformers.GPT2LMHeadModel(config)
    if kind == "llama":  # rope past the llama3 scaling's original context (16) within the 48 positions
        config = transformers.LlamaConfig(
            vocab_size=512, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=48, initializer_range=1.0, bos_token_id=0,
            eos_token_id=0, pad_token_id=0, rope_scaling=dict(rope_type="llama3", factor=4.0, low_freq_factor=1.0,
                                                             high_freq_factor=4.0, original_max_position_embeddings=16))
        return transformers.LlamaForCausalLM(config)
    gated = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False) if kind == "t5v11" else {}
    config = transformers.T5Config(vocab_size=512 + SENTINELS, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=16,
                                   initializer_factor=5.0, decoder_start_token_id=0, pad_token_id=0, eos_token_id=0,
                                   **gated)
    return transformers.T5ForConditionalGeneration(config)


def _hf_folder(kind: str, out: str) -> str:
    _hf_model(kind).save_pretrained(out)
    shutil.copy(common.VOCAB, out)
    shutil.copy(common.MERGES, out)
    sentinels = {} if kind in ("gpt2", "llama") else {str(512 + k): {"content": f"<extra_id_{k}>", "special": True}
                                           for k in range(SENTINELS)}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "GPT2Tokenizer", "added_tokens_decoder": sentinels}, f)
    return out


def _until_end(ids: list, end: int) -> list:
    return ids[:ids.index(end)] if end in ids else ids


@torch.no_grad()
def _hf_greedy(model, t5: bool, prompt_ids: list, tokenizer) -> list:
    """transformers' greedy tokens after one prompt (without the prompt / decoder start, up to the end id)."""
    ids = torch.tensor([prompt_ids])
    end = tokenizer.eos if t5 else tokenizer.eod
    extra = dict(decoder_start_token_id=tokenizer.pad) if t5 else {}
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW,
                         eos_token_id=end, pad_token_id=tokenizer.pad, **extra)[0].tolist()
    return _until_end(out[1:] if t5 else out[len(prompt_ids):], end)


@pytest.mark.parametrize("kind", ["gpt2", "llama", "t5", "t5v11"])
def test_greedy_tokens_equal_transformers(kind, tmp_path):
    from megatron.inference import GenerationParams, generate, loading
    from tools import convert_checkpoint
    hf_dir, ckpt, exported = (str(tmp_path / name) for name in ("hf", "ckpt", "exported"))
    layout = ["1", "2"] if kind.startswith("t5") else ["2", "1"]
    convert_checkpoint.run(["import-hf", "--input", _hf_folder(kind, hf_dir), "--save", ckpt,
                            "--tensor-model-parallel-size", layout[0], "--pipe-parallel-size", layout[1]])
    convert_checkpoint.run(["export-hf", "--load", ckpt, "--output", exported])
    loaded = loading.load(ckpt)
    tokenizer, t5 = loaded.tokenizer, kind.startswith("t5")
    assert len(tokenizer.sentinel_ids) == (SENTINELS if t5 else 0)
    hf = (transformers.T5ForConditionalGeneration if t5 else transformers.AutoModelForCausalLM).from_pretrained(exported)
    prompts = PROMPTS["t5" if t5 else "gpt2"]
    ours = generate(loaded.model, tokenizer, prompts, GenerationParams(max_new_tokens=NEW))
    assert len({t for c in ours for t in c.ids}) > len(prompts), "greedy text should not be degenerate"
    for c in ours:
        want = _hf_greedy(hf.eval(), t5, c.prompt_ids, tokenizer)
        assert c.ids == want, f"{kind} prompt {c.prompt!r}: ours {c.ids}, transformers {want}"
    if not t5:  # one left-padded batch through transformers as well
        rows = [c.prompt_ids for c in ours]
        width = max(len(r) for r in rows)
        ids = torch.tensor([[tokenizer.pad] * (width - len(r)) + r for r in rows])
        mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
        with torch.no_grad():
            batch = hf.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=NEW,
                                eos_token_id=tokenizer.eod, pad_token_id=tokenizer.pad)[:, width:].tolist()
        assert [_until_end(b, tokenizer.eod) for b in batch] == [c.ids for c in ours]
