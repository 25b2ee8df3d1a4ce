"""Zero-shot tasks in one process: lm-ppl against the cross entropy computed by hand, window by window
(Megatron's overlapping evaluation), the adjusted perplexity's token ratio, WikiText's detokenizer, and
LAMBADA on a crafted file whose answers are known."""
from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from megatron.errors import UserError
from megatron.inference import evaluate_lambada, evaluate_lm, read_lambada, read_lm_text
from megatron.inference.detokenize import wikitext
from megatron.inference.lm_ppl import windows
from tests.inference import common

TEXT = ("The model data parallel pipeline . Tensor stage gradient token , layer attention batch ! "
        "Optimizer schedule checkpoint memory throughput sequence embedding vocabulary = = heading = = \n"
        "the 1 @,@ 000 tokens of 3 @.@ 5 models ( and more ) \" quoted \" \n") * 2
SEQ = 16


@torch.no_grad()
def _hand_loss(model, tokens: list, seq: int, stride: int) -> float:
    """Mean cross entropy of every target j >= 1, each predicted from the window Megatron gives it:
    tokens [0, seq] for j <= seq, else the window starting at the multiple of stride that ends at or
    after j with j among its last `stride` targets."""
    losses = []
    for j in range(1, len(tokens)):
        start = 0 if j <= seq else stride * math.ceil((j - seq) / stride)
        window = torch.tensor([tokens[start:j]])
        logits = model(window)[0, -1]  # (V_pad,), tp = 1: the whole vocabulary
        losses.append(F.cross_entropy(logits.unsqueeze(0), torch.tensor([tokens[j]])).item())
    return sum(losses) / len(losses)


def test_lm_ppl_matches_hand_computation(tmp_path):
    tokenizer = common.bpe_tokenizer()
    model = common.gpt2_model(vocab_size=tokenizer.vocab_size)
    path = tmp_path / "wiki.valid.tokens"
    path.write_text(TEXT)
    text = read_lm_text(str(path), tokenizer)  # 'wiki' in the name: WikiText detokenizer
    assert text.tokens == tokenizer.tokenize(wikitext(TEXT))
    assert text.num_original_tokens == len(TEXT.strip().split(" "))
    assert len(text.tokens) > 3 * SEQ
    for stride in (SEQ, 5):
        result = evaluate_lm(model, text, SEQ, stride, batch_size=3, pad=tokenizer.eod)
        want = _hand_loss(model, text.tokens, SEQ, stride)
        assert abs(result.loss - want) <= 1e-5 * want, (stride, result.loss, want)
        assert math.isclose(result.ppl, math.exp(result.loss), rel_tol=1e-12)
        ratio = (len(text.tokens) - 1) / (text.num_original_tokens - 1)
        assert math.isclose(result.token_ratio, ratio) and math.isclose(result.adjusted_ppl,
                                                                        math.exp(result.loss * ratio))
        assert result.windows == len(windows(len(text.tokens), SEQ, stride))
    with pytest.raises(UserError, match="--overlapping-eval 17 must be between 1 and the sequence length 16"):
        evaluate_lm(model, text, SEQ, 17, batch_size=3, pad=tokenizer.eod)


def test_windows_score_each_target_once():
    for n, seq, stride in ((50, 16, 16), (50, 16, 5), (17, 16, 4), (5, 16, 3), (100, 8, 1)):
        scored = []
        for start, first in windows(n, seq, stride):
            last = min(start + seq, n - 1)  # targets start+1 .. start+seq that exist
            scored += list(range(start + first + 1, last + 1))
        assert scored == list(range(1, n)), (n, seq, stride)


def test_wikitext_detokenizer():
    assert wikitext("the 1 @,@ 000 men 's 3 @.@ 5 km @-@ long = = Title = = ( a b ) \" q \" , the players '") == \
        "the 1,000 men's 3.5 km-long == Title == (a b) \"q\", the players'"
    assert wikitext("it was 5 \u00b0 C . next") == "it was 5\u00b0C. next"


def _crafted_lambada(model, tokenizer, path, n: int = 12):
    """Passages whose last token is the model's greedy prediction (even k) or not (odd k); kept only when
    the text tokenizes back to the same ids, so the expected answers are known. Returns the count correct."""
    words = "the model data parallel pipeline tensor stage gradient token layer attention batch".split()
    lines, correct = [], 0
    for k in range(200):
        context = tokenizer.tokenize(" ".join(words[(k + i) % len(words)] for i in range(3 + k % 5)))
        with torch.no_grad():
            ranked = model(torch.tensor([context]))[0, -1, :tokenizer.vocab_size].argsort(descending=True)
        target = int(ranked[0] if len(lines) % 2 == 0 else ranked[1])
        text = tokenizer.detokenize(context + [target])
        if tokenizer.tokenize(text) != context + [target] or target == tokenizer.eod:
            continue
        correct += len(lines) % 2 == 0
        lines.append(json.dumps({"text": text}))
        if len(lines) == n:
            break
    path.write_text("\n".join(lines) + "\n")
    return correct, len(lines)


@torch.no_grad()
def _strict_by_hand(model, tokenizer, path) -> int:
    correct = 0
    for line in path.read_text().splitlines():
        text = json.loads(line)["text"]
        word = text.split()[-1]
        context = tokenizer.tokenize(text[:text.rfind(word)].strip())
        target = tokenizer.tokenize(" " + word)
        logits = model(torch.tensor([context + target[:-1]]))[0, len(context) - 1:, :tokenizer.vocab_size]
        correct += logits.argmax(-1).tolist() == target
    return correct


def test_lambada_on_a_crafted_file(tmp_path):
    tokenizer = common.bpe_tokenizer()
    model = common.gpt2_model(vocab_size=tokenizer.vocab_size)
    path = tmp_path / "lambada.jsonl"
    want, total = _crafted_lambada(model, tokenizer, path)
    assert total == 12 and want == 6
    examples = read_lambada(str(path), tokenizer, strict=False)
    result = evaluate_lambada(model, examples, 48, batch_size=5, pad=tokenizer.eod, strict=False)
    assert (result.correct, result.examples, result.accuracy) == (6, 12, 0.5)
    strict = evaluate_lambada(model, read_lambada(str(path), tokenizer, strict=True), 48, batch_size=5,
                              pad=tokenizer.eod, strict=True)
    assert strict.correct == _strict_by_hand(model, tokenizer, path) and strict.examples == 12
    short = evaluate_lambada(model, examples, 4, batch_size=5, pad=tokenizer.eod, strict=False)
    assert short.truncated == sum(len(c) + len(t) > 5 for c, t in examples) > 0
    path.write_text('{"text": "fine words here"}\n{"txt": "no"}\n')
    with pytest.raises(UserError, match="lambada.jsonl line 2: not a JSON object with a non-empty string "
                                        "field 'text'"):
        read_lambada(str(path), tokenizer, strict=True)
