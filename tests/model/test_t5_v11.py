"""T5 v1.1: gated-GELU feed-forward, untied LM head (no d_model^-0.5 scaling), a decoder deeper than the
encoder and non-default relative-attention buckets.

- Single process: T5Model equals the independent reference (tests/model/reference_impl.py) and its untied
  head is a separate `lm_head.weight`, initialised N(0, 1) as HF's, the only new parameter.
- T5ModelPipe on the TDS engine at (tp, pp, dp) = (1, 1, 1) with dropout on and (2, 2, 2) (the balanced
  split of 2 + 3 layers puts the stage boundary between decoder layers 1 and 2) gives the losses of 3 SGD
  steps, the first-step gradients (the untied head's included) and the eval loss of the single-process plain
  model (fp32, relative error < 1e-5).
  Dropout masks are drawn per micro-batch of a replica (megatron/model/rng.py), so with dp = 2 they differ
  from the single process's by design: the (2, 2, 2) runs have dropout off, as the v1.0 layout tests.
"""
from __future__ import annotations

import torch

from megatron.model.t5_model import T5Model
from harness.dist import run_distributed
from tests.model import common, reference_impl

V11 = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False, num_layers=2, num_decoder_layers=3,
           relative_attention_num_buckets=16, relative_attention_max_distance=20)
DROPOUT = dict(hidden_dropout=0.1, attention_dropout=0.1)
STEPS = 3
TOL = 1e-5
HEAD_KEY = "8.weight"  # specs: 0 embedding, 1-2 encoder, 3 encoder norm, 4-6 decoder, 7 decoder norm, 8 head


def test_v11_matches_reference_and_has_an_untied_head():
    cfg = common.t5_config(**V11)
    model = T5Model(cfg).eval()
    inputs, _ = common.t5_batch(cfg, 2, torch.Generator().manual_seed(5))
    got = model(*inputs)[..., :cfg.vocab_size]
    sd = model.state_dict()
    assert common.rel_err(got, reference_impl.t5_logits(sd, cfg, *inputs)) < TOL
    tied_sd = T5Model(common.t5_config(**{**V11, "tie_word_embeddings": True})).state_dict()
    assert set(sd) - set(tied_sd) == {"lm_head.weight"} and set(tied_sd) <= set(sd)
    head, table = sd["lm_head.weight"], sd["embedding.word_embeddings.weight"]
    assert head.shape == table.shape == (cfg.padded_vocab_size(1), cfg.hidden_size)
    assert 0.9 < head.std().item() < 1.1 and not torch.equal(head, table)
    # the scaling is applied only when tied: the same weights with the table as head differ by d^-0.5
    untied_as_tied = dict(sd, **{"lm_head.weight": table})
    scaled = reference_impl.t5_logits(untied_as_tied, cfg, *inputs) * cfg.hidden_size ** -0.5
    tied_cfg = common.t5_config(**{**V11, "tie_word_embeddings": True})
    assert common.rel_err(scaled, reference_impl.t5_logits(sd, tied_cfg, *inputs)) < TOL


def _job(tp: int, pp: int, dp: int, partition="type:TransformerLayer", dropout: bool = False) -> dict:
    config_kw = {**V11, **(DROPOUT if dropout else {})}
    return dict(kind="t5", tp=tp, pp=pp, dp=dp, config_kw=config_kw, steps=STEPS, partition=partition)


def _check(per_rank: list, jobs: list) -> None:
    for j, job in enumerate(jobs):
        tp, dp = job["tp"], job["dp"]
        config = common.t5_config(**job["config_kw"])
        ref = common.reference_run("t5", config, common.make_batches("t5", config, STEPS,
                                                                     common.MBS * common.GAS * dp))
        results = [r[j] for r in per_rank]
        where = f"T5 v1.1 (tp, pp, dp) = {(tp, job['pp'], dp)}, partition {job['partition']}"
        for r in results:
            for step, (got, want) in enumerate(zip(r["losses"], ref["losses"])):
                assert abs(got - want) <= TOL * abs(want), f"{where}: step {step} loss {got} vs plain {want}"
            assert abs(r["eval_loss"] - ref["eval_loss"]) <= TOL * abs(ref["eval_loss"]), where
        assert HEAD_KEY in ref["grads"]  # the untied head's gradient is compared too
        assert common.check_grads(results, ref["grads"], tp, TOL) == len(ref["grads"])


def test_v11_pipe_matches_plain_model_111():
    jobs = [_job(1, 1, 1, dropout=True)]
    _check(run_distributed(common.run_jobs, 1, jobs, timeout=300), jobs)


def test_v11_pipe_matches_plain_model_222():
    jobs = [_job(2, 2, 2)]
    per_rank = run_distributed(common.run_jobs, 8, jobs, timeout=500)
    _check(per_rank, jobs)
    assert per_rank[0][0]["parts"] == [0, 5, 9]  # 2 + 3 layers balanced: the boundary is inside the decoder
