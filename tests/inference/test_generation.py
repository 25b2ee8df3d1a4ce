"""Generation in one process: the key-value cache gives exactly the tokens of recomputing the whole
sequence (GPT-2, the Llama, Qwen3 and OLMo-2 layers (whose caches hold normalised keys) and T5, batched prompts
of different lengths), the recomputing path equals the model's own
forward on each unpadded prompt, batching and sampling are independent of the batch, stop conditions,
bad prompts."""
from __future__ import annotations

import json

import pytest
import torch

from megatron.errors import UserError
from megatron.inference import GenerationParams, Sampling, generate, make_runner
from megatron.inference.generate import encode_prompts
from megatron.inference.prompts import encode_t5, read_prompt_file
from megatron.inference.sampling import gather_vocab, sample
from tests.inference import common

STEPS = 16
GPT_LAYERS = {"gpt2": {}, "llama": common.LLAMA, "qwen3": common.QWEN3, "olmo2": common.OLMO2}


def _model(kind: str, spm_model: str):
    """kind: gpt2, llama (rope, RMSNorm, SwiGLU, 2 query groups of 2 heads, no biases, untied head), qwen3 (llama
    with --qk-layernorm), olmo2 (llama with --qk-layernorm-full --post-sublayer-norm), t5 (v1.0: relu, tied head)
    or t5v11 (gated GELU, untied head)."""
    if kind in GPT_LAYERS:
        tokenizer = common.bpe_tokenizer()
        return common.gpt2_model(vocab_size=tokenizer.vocab_size, **GPT_LAYERS[kind]), tokenizer, common.PROMPTS
    tokenizer = common.spm_tokenizer(spm_model)
    v11 = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False) if kind == "t5v11" else {}
    return common.t5_model(tokenizer.vocab_size, **v11), tokenizer, common.T5_PROMPTS


@torch.no_grad()
def _greedy(runner, steps: int):
    """tokens (b, steps), logits (b, steps, V_r) of greedy decoding."""
    tokens, logits = [], [runner.first()]
    for step in range(steps):
        tokens.append(logits[-1].argmax(-1))
        if step + 1 < steps:
            logits.append(runner.next(tokens[-1]))
    return torch.stack(tokens, 1), torch.stack(logits, 1)


@torch.no_grad()
def _reference_logits(model, kind: str, prompt: list, generated: list) -> torch.Tensor:
    """(steps, V_r): the model's own forward on one unpadded sequence."""
    if kind in GPT_LAYERS:
        seq = torch.tensor([prompt + generated[:-1]])
        return model(seq)[0, len(prompt) - 1:]
    enc, dec = torch.tensor([prompt]), torch.tensor([[0] + generated[:-1]])
    se, sd = enc.size(1), dec.size(1)
    causal = torch.ones(sd, sd, dtype=torch.bool).triu(1).view(1, 1, sd, sd)
    none = torch.zeros(1, 1, sd, se, dtype=torch.bool)
    return model(enc, dec, torch.zeros(1, 1, se, se, dtype=torch.bool), causal, none)[0]


@pytest.mark.parametrize("kind", [*GPT_LAYERS, "t5", "t5v11"])
def test_cache_equals_recompute_and_model_forward(kind, spm_model):
    model, tokenizer, prompts = _model(kind, spm_model)
    ids = encode_prompts(model.config, tokenizer, prompts)
    assert len({len(r) for r in ids}) >= 3, "prompts of different lengths"
    runner = make_runner(model, ids, STEPS, tokenizer.pad, use_cache=True)
    cached, cached_logits = _greedy(runner, STEPS)
    if kind in ("llama", "qwen3", "olmo2"):  # the cache holds the 2 key/value groups, not the 4 query heads
        assert runner.caches[0].self_attention.keys.shape[1] == 2
    full, full_logits = _greedy(make_runner(model, ids, STEPS, tokenizer.pad, use_cache=False), STEPS)
    assert torch.equal(cached, full), f"{kind}: cached {cached.tolist()} vs recomputed {full.tolist()}"
    scale = full_logits.abs().max().item()
    torch.testing.assert_close(cached_logits, full_logits, rtol=1e-5, atol=1e-5 * scale)
    assert len(set(cached.flatten().tolist())) > 2 * len(prompts), "greedy text should not be degenerate"
    for i, row in enumerate(ids):  # batched + padded == each prompt alone through model.forward
        ref = _reference_logits(model, kind, row, cached[i].tolist())
        torch.testing.assert_close(cached_logits[i], ref, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("kind", ["gpt2", "t5"])
def test_generate_is_independent_of_batching(kind, spm_model):
    model, tokenizer, prompts = _model(kind, spm_model)
    sampled = Sampling(temperature=0.9, top_k=40, top_p=0.95)
    runs = {}
    for name, params in (("greedy", GenerationParams(max_new_tokens=10, batch_size=1)),
                         ("greedy_b3", GenerationParams(max_new_tokens=10, batch_size=3)),
                         ("seed5", GenerationParams(max_new_tokens=10, sampling=sampled, seed=5, batch_size=1)),
                         ("seed5_b8", GenerationParams(max_new_tokens=10, sampling=sampled, seed=5, batch_size=8)),
                         ("seed6", GenerationParams(max_new_tokens=10, sampling=sampled, seed=6, batch_size=8))):
        runs[name] = [(c.ids, c.text) for c in generate(model, tokenizer, prompts, params)]
    assert runs["greedy"] == runs["greedy_b3"]
    assert runs["seed5"] == runs["seed5_b8"]
    assert runs["seed5"] != runs["seed6"] and runs["seed5"] != runs["greedy"]


def test_sample_filters_and_distribution():
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, -1.0]])
    n = 4000
    u = (torch.arange(n, dtype=torch.float64) + 0.5) / n  # an even grid stands in for the random draws
    rows = logits.expand(n, -1)
    for sampling, allowed in ((Sampling(1.0), [0, 1, 2, 3, 4]), (Sampling(1.0, top_k=2), [2, 3]),
                              (Sampling(1.0, top_p=0.7), [2, 3]), (Sampling(0.5, top_k=3), [1, 2, 3])):
        picked = sample(rows, sampling, u)
        probs = torch.softmax(logits[0, allowed] / sampling.temperature, -1)
        freq = torch.tensor([(picked == a).double().mean().item() for a in allowed], dtype=torch.float64)
        assert (picked.unsqueeze(1) == torch.tensor(allowed)).any(1).all(), (sampling, picked.unique())
        torch.testing.assert_close(freq, probs.double(), atol=2.0 / n, rtol=0)
    assert sample(logits, Sampling(1.0, top_k=1), torch.tensor([0.99])).item() == 3
    assert sample(logits, Sampling(), torch.tensor([0.5])).item() == 3
    padded = torch.cat([logits, torch.full((1, 3), 100.0)], 1)  # ids 5..7 are vocabulary padding
    assert gather_vocab(padded, 5).argmax(-1).item() == 3


def test_stop_conditions_and_limits():
    tokenizer = common.bpe_tokenizer()
    model = common.gpt2_model(vocab_size=tokenizer.vocab_size)
    greedy = generate(model, tokenizer, ["The model"], GenerationParams(max_new_tokens=12))[0]
    assert greedy.finish == "length" and len(greedy.ids) == 12
    stop = tokenizer.detokenize(greedy.ids[4:6])
    cut = generate(model, tokenizer, ["The model"], GenerationParams(max_new_tokens=12, stop=[stop]))[0]
    assert cut.finish == "stop" and cut.text == greedy.text[:greedy.text.find(stop)]

    class EodIs:  # the same tokenizer with another end-of-document id
        def __init__(self, eod):
            self.eod = eod

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    first = greedy.ids.index(greedy.ids[3])
    ended = generate(model, EodIs(greedy.ids[3]), ["The model"], GenerationParams(max_new_tokens=12))[0]
    assert ended.finish == "eod" and ended.ids == greedy.ids[:first]
    long_prompt = "data"
    while len(tokenizer.tokenize(long_prompt + " data")) <= 40:  # at most 40 of the model's 48 positions
        long_prompt += " data"
    n = len(tokenizer.tokenize(long_prompt))
    limited = generate(model, tokenizer, [long_prompt], GenerationParams(max_new_tokens=20))[0]
    assert len(limited.ids) == 48 - n and limited.finish == "length"


def test_bad_prompts(spm_model, tmp_path):
    tokenizer = common.bpe_tokenizer()
    model = common.gpt2_model(vocab_size=tokenizer.vocab_size)
    with pytest.raises(UserError, match=r"prompt 1 has 180 tokens but the model has 48 positions \(max_position"
                                         r"_embeddings\), so at most 47 leave room to generate; shorten it"):
        encode_prompts(model.config, tokenizer, ["ok", " data" * 60])
    spm = common.spm_tokenizer(spm_model)
    ids = encode_t5("The <extra_id_0> sat <extra_id_9>", spm)
    assert spm.sentinel_ids[0] in ids and spm.sentinel_ids[9] in ids and ids[-1] == spm.eos
    with pytest.raises(UserError, match=r"unknown sentinel <extra_id_10>; this tokenizer has 10"):
        encode_t5("The <extra_id_10> sat", spm)
    plain, jsonl = tmp_path / "p.txt", tmp_path / "p.jsonl"
    plain.write_text("first prompt\n\nsecond\n")
    jsonl.write_text(json.dumps({"q": "one"}) + "\n" + json.dumps({"q": "two"}) + "\n")
    assert read_prompt_file(str(plain)) == ["first prompt", "second"]
    assert read_prompt_file(str(jsonl), "q") == ["one", "two"]
    with pytest.raises(UserError, match="line 1 has no string field 'text'; name the field with --json-key"):
        read_prompt_file(str(jsonl))
    jsonl.write_text('{"text": "fine"}\n{"text": broken\n')
    with pytest.raises(UserError, match="p.jsonl line 2 is not valid JSON"):
        read_prompt_file(str(jsonl))
