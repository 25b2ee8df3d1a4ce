"""--compile (megatron/model/compile.py): each transformer layer compiled with inductor, through `pretrain`, equals
the eager single process (fp32, relative error < 1e-5 on losses and gradient norms; clipping active): GPT-2 with
dropout on at pp = 2 with every schedule (ZB-H1 falls back to eager layers, one line) and selective recomputation;
with the fused loss, the Llama-style GPT and T5 at (1, 1, 1) against the golden files (20 iterations), and the
Llama-style GPT at (2, 2, 2) ZeRO-1 against (1, 1, 1)."""
import json

import numpy as np
import pytest
import torch

from tests.training.golden_cases import golden_path, run
from tests.training.test_pipeline_schedules_pretrain import INTERLEAVED, ZB_H1, assert_schedules_match_one_process
from tests.training.test_pipeline_schedules_pretrain import data_prefix  # noqa: F401 (fixture)

COMPILE = ["--compile"]


def test_fallback_and_compiled_layers():
    from megatron.model.compile import compile_layers
    from megatron.model.config import GPT2Config
    from megatron.model.gpt2_pipe import GPT2TransformerLayerPipe
    cfg = GPT2Config(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)
    stage = torch.nn.Sequential(GPT2TransformerLayerPipe(cfg, 1), GPT2TransformerLayerPipe(cfg, 2))
    line = compile_layers(stage, "zb-h1")
    assert line.startswith("--compile: every transformer layer runs eagerly: ZB-H1") and "\n" not in line
    assert all("_forward" not in vars(layer) for layer in stage)
    assert compile_layers(stage, "1f1b").startswith("--compile: each transformer layer runs compiled")
    assert all("_forward" in vars(layer) for layer in stage)  # compiled lazily, on the first call


def test_gpt2_single_process_compiled_equals_golden(data_prefix):  # noqa: F811
    with open(golden_path("gpt2")) as f:
        golden = np.array(json.load(f)["losses"])
    losses, _ = run("gpt2", data_prefix, 1, 1, 1, extra=COMPILE)
    assert len(losses) == len(golden) > 0
    np.testing.assert_allclose(losses, golden, rtol=1e-5)


@pytest.mark.long
def test_gpt2_compiled_with_every_schedule_equals_one_eager_process(data_prefix):  # noqa: F811
    schedules = {"1f1b": COMPILE, "zb-h1 (eager layers)": COMPILE + ZB_H1, "interleaved": COMPILE + INTERLEAVED,
                 "1f1b selective": COMPILE + ["--recompute-granularity", "selective"]}
    assert_schedules_match_one_process(data_prefix, schedules, "GPT-2 pp=2 --compile", timeout=1200)


@pytest.mark.long
@pytest.mark.parametrize("model", ["llama", "t5"])
def test_compiled_with_the_fused_loss_equals_golden(model, data_prefix):  # noqa: F811
    """The Llama-style GPT's and T5's layers compiled with the fused loss at (1, 1, 1) against their golden files
    (GPT-2's compiled layers: the golden test above and every schedule at pp 2); the Llama-style GPT
    (grouped-query attention split over tp, rotary, SwiGLU) also at (2, 2, 2) with ZeRO-1 against (1, 1, 1): eight
    ranks each compiling take minutes on 2 cores, so one model's layer runs them (GPT-2's compiled layers run at
    pp 2 with every schedule above)."""
    with open(golden_path(model)) as f:
        golden = np.array(json.load(f)["losses"])
    flags = COMPILE + ["--cross-entropy-loss-fusion"]
    single, single_norms = map(np.array, run(model, data_prefix, 1, 1, 1, extra=flags))
    assert len(single) == len(golden) > 0
    np.testing.assert_allclose(single, golden, rtol=1e-5, err_msg="(1,1,1) --compile, fused loss vs golden")
    if model != "llama":
        return
    parallel, parallel_norms = map(np.array, run(model, data_prefix, 2, 2, 2, extra=flags))
    assert len(parallel) == len(single)
    np.testing.assert_allclose(parallel, single, rtol=1e-5, err_msg="(2,2,2) ZeRO-1 vs (1,1,1)")
    np.testing.assert_allclose(parallel_norms, single_norms, rtol=1e-4)
