"""Prediction against measurement: the planner's per-rank peak for small GPT-2, Llama-style GPT and T5 layouts against
the peak that megatron/training/memory_log.py measures on gloo ranks (bench/memory_error.py runs the full table)."""
import json

import pytest

from megatron.training.memory_probe import measure_rank, predicted_peaks
from harness.dist import run_distributed

GPT = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
       "--micro-batch-size", "2", "--train-iters", "10", "--make-vocab-size-divisible-by", "8"]
T5 = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--encoder-seq-length", "64",
      "--decoder-seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10",
      "--make-vocab-size-divisible-by", "8"]
LLAMA = GPT + ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
               "--num-query-groups", "2", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
               "--hidden-dropout", "0", "--attention-dropout", "0"]
MODELS = {"gpt": ("gpt", GPT), "t5": ("t5", T5), "llama": ("gpt", LLAMA)}  # bench/memory_error.py's
VOCAB = 1000  # bench/memory_error.py's layouts
TOLERANCE = 0.10  # the goal for every layout


def _check(model, world, extra, tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 1_000_000}}))
    model_type, flags = MODELS[model]
    argv = flags + extra + ["--deepspeed_config", str(cfg)]
    predicted = predicted_peaks(argv, world, model_type, VOCAB)
    for r in run_distributed(measure_rank, world, argv, world, model_type, VOCAB, timeout=600):
        measured = r["peak"].peak
        assert abs(predicted[r["pp_rank"]] - measured) / measured < TOLERANCE, (r, predicted)


def test_pipeline_two_stages_within_tolerance(tmp_path):
    _check("gpt", 2, ["--gas", "4", "--pipe-parallel-size", "2", "--zero-stage", "0"], tmp_path)


def test_sequence_parallel_within_tolerance(tmp_path):
    """The all-to-alls' buffers die on gloo's thread, where the profiler records no free: without pairing
    addresses (memory_log._rise) this layout measured 10-20 % above the prediction, differently every run."""
    _check("gpt", 2, ["--gas", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel", "--zero-stage", "0"],
           tmp_path)


def test_llama_layer_pipeline_two_stages_within_tolerance(tmp_path):
    """Rope, RMSNorm, SwiGLU, grouped-query attention, no biases, the untied head on the last stage."""
    _check("llama", 2, ["--gas", "4", "--pipe-parallel-size", "2", "--zero-stage", "0"], tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("model,world,extra", [
    ("gpt", 2, ["--gas", "2", "--tensor-model-parallel-size", "2", "--zero-stage", "0"]),
    ("gpt", 2, ["--gas", "2", "--zero-stage", "1", "--bf16"]),
    ("t5", 2, ["--gas", "4", "--pipe-parallel-size", "2", "--zero-stage", "0"]),
])
def test_more_layouts_within_tolerance(model, world, extra, tmp_path):
    _check(model, world, extra, tmp_path)
