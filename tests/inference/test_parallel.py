"""Generation and the zero-shot tasks on 2 processes: at tp=2 the text equals tp=1 (greedy, and sampling with
the same seed; GPT-2 and T5, padded vocabulary on the last tp rank), and at dp=2 generation, lm-ppl and
lambada give exactly the single-process results. One run_distributed call does both layouts."""
from __future__ import annotations

from harness.dist import run_distributed
from tests.inference import common

SAMPLED = dict(temperature=0.8, top_k=30, top_p=0.9)
SEQ, STRIDE = 16, 6


def _lm_text():
    from megatron.inference.lm_ppl import LMText
    tokenizer = common.bpe_tokenizer()
    tokens = tokenizer.tokenize(" ".join(common.PROMPTS + common.T5_PROMPTS) * 3)
    return LMText(tokens, 150)


def _examples():
    tokenizer = common.bpe_tokenizer()
    rows = [tokenizer.tokenize(p + " data model") for p in common.PROMPTS[:4] + common.T5_PROMPTS]
    return [(r[:-2], r[-2:]) for r in rows]


def _everything(par, spm_model: str) -> dict:
    """Greedy and sampled completions of GPT-2 and T5, lm-ppl and lambada, on this layout."""
    from megatron.inference import GenerationParams, Sampling, evaluate_lambada, evaluate_lm, generate
    tokenizer, spm = common.bpe_tokenizer(), common.spm_tokenizer(spm_model)
    gpt2 = common.gpt2_model(par.tp_group, tokenizer.vocab_size, make_vocab_size_divisible_by=96)
    t5 = common.t5_model(spm.vocab_size, par.tp_group)
    out = {}
    for name, model, tok, prompts in (("gpt2", gpt2, tokenizer, common.PROMPTS), ("t5", t5, spm, common.T5_PROMPTS)):
        for mode, sampling in (("greedy", Sampling()), ("sampled", Sampling(**SAMPLED))):
            params = GenerationParams(max_new_tokens=10, sampling=sampling, seed=3, batch_size=2)
            out[f"{name}_{mode}"] = [(c.ids, c.text, c.finish) for c in generate(model, tok, prompts, params, par)]
    out["lm"] = evaluate_lm(gpt2, _lm_text(), SEQ, STRIDE, 2, tokenizer.eod, par).to_dict()
    out["lambada"] = evaluate_lambada(gpt2, _examples(), SEQ, 2, tokenizer.eod, True, par).to_dict()
    return out


def _ranks(spm_model: str) -> dict:
    from megatron import mpu
    from megatron.inference.parallel import Parallel
    results = {"tp2": _everything(Parallel.from_state(mpu.initialize_model_parallel(2, 1)), spm_model)}
    results["dp2"] = _everything(Parallel.from_state(mpu.initialize_model_parallel(1, 1)), spm_model)
    mpu.destroy_model_parallel()
    return results


def test_tp2_equals_tp1_and_dp2_equals_one_process(spm_model):
    from megatron.inference.parallel import Parallel
    per_rank = run_distributed(_ranks, 2, spm_model, timeout=300)
    single = _everything(Parallel.single(), spm_model)
    assert per_rank[0] == per_rank[1], "every rank returns the same gathered results"
    got = per_rank[0]
    assert got["dp2"] == single, "dp=2 must reproduce one process exactly"
    for key in ("gpt2_greedy", "gpt2_sampled", "t5_greedy", "t5_sampled"):
        assert got["tp2"][key] == single[key], f"{key}: tp=2 {got['tp2'][key]} vs tp=1 {single[key]}"
    assert single["gpt2_sampled"] != single["gpt2_greedy"] and single["t5_sampled"] != single["t5_greedy"]
    lm2, lm1 = got["tp2"]["lm"], single["lm"]
    assert abs(lm2["loss"] - lm1["loss"]) <= 1e-5 * lm1["loss"] and lm2["windows"] == lm1["windows"] > 2
    assert got["tp2"]["lambada"] == single["lambada"]
