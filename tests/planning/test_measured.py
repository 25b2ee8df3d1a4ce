"""Prediction against measurement: the planner's per-rank peak for small GPT-2, Llama-style GPT, mixture-of-experts
and T5 layouts against the peak that megatron/training/memory_log.py measures on gloo ranks (bench/memory_error.py
runs the full table)."""
import json

import pytest

from megatron.config.arguments import ENTRY_DEFAULTS, parse_args
from megatron.planning.model_shape import ModelShape, layer_specs
from megatron.planning.moe import MoEPipeLayer
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
# the golden MoE model's experts (tests/training/golden_cases.py: 8, top-2, a shared expert of 32, the aux and z
# losses, an fp64 router), wider (96) and top-4 in three of the four layers: the MoE terms are half the activations
MOE = LLAMA + ["--num-experts", "8", "--moe-router-topk", "4", "--moe-ffn-hidden-size", "96",
               "--moe-shared-expert-intermediate-size", "32", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff",
               "0.001", "--moe-router-dtype", "fp64", "--moe-layer-freq", "[0,1,1,1]"]
# bench/memory_error.py's (moe: bench/probes/moe_memory_error.py's)
MODELS = {"gpt": ("gpt", GPT), "t5": ("t5", T5), "llama": ("gpt", LLAMA), "moe": ("gpt", MOE)}
VOCAB = 1000  # bench/memory_error.py's layouts
TOLERANCE = 0.10  # the goal for every layout


def _argv(model, extra, tmp_path) -> list:
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps({"zero_optimization": {"reduce_bucket_size": 1_000_000}}))
    return MODELS[model][1] + extra + ["--deepspeed_config", str(cfg)]


def _check(model, world, extra, tmp_path):
    argv = _argv(model, extra, tmp_path)
    predicted = predicted_peaks(argv, world, MODELS[model][0], VOCAB)
    for r in run_distributed(measure_rank, world, argv, world, MODELS[model][0], VOCAB, timeout=600):
        measured = r["peak"].peak
        assert abs(predicted[r["pp_rank"]] - measured) / measured < TOLERANCE, (r, predicted)


def measure_ranks(argvs, world_size: int, model_type: str, vocab_size: int) -> list:
    """One rank's `measure_rank` of each command line in turn: several layouts in one launch."""
    return [measure_rank(argv, world_size, model_type, vocab_size) for argv in argvs]


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


def test_mixture_of_experts_within_tolerance(tmp_path):
    """Expert parallelism 1 and 2 dropless and 2 at capacity factor 0.5 (every expert full), data-parallel 2, in one
    launch; the experts' parameters per rank halve from ep 1 to ep 2, measured and predicted alike."""
    base = ["--gas", "2", "--zero-stage", "0"]
    extras = {"ep1": base, "ep2": base + ["--expert-model-parallel-size", "2"],
              "capacity": base + ["--expert-model-parallel-size", "2", "--moe-expert-capacity-factor", "0.5"]}
    argvs = [_argv("moe", extra, tmp_path) for extra in extras.values()]
    predicted = [predicted_peaks(argv, 2, "gpt", VOCAB)[0] for argv in argvs]
    measured = [[r["peak"] for r in rank] for rank in run_distributed(measure_ranks, 2, argvs, 2, "gpt", VOCAB,
                                                                         timeout=600)]
    for rank in measured:
        for name, peak, want in zip(extras, rank, predicted):
            assert abs(want - peak.peak) / peak.peak < TOLERANCE, (name, peak, want)
    args = [parse_args(list(argv), defaults=ENTRY_DEFAULTS["gpt"], world_size=2) for argv in argvs[:2]]
    experts = [sum(s.experts for s in layer_specs(ModelShape.from_args(a, VOCAB), 1, a.expert_model_parallel_size)
                   if isinstance(s, MoEPipeLayer)) for a in args]
    assert experts[1] * 2 == experts[0] == 3 * 3 * 64 * 96 * 8  # 3 MoE layers of 8 experts (2 f_e h + h f_e)
    for rank in measured:
        assert rank[0].parameters - rank[1].parameters == 4 * experts[1]  # fp32: half the experts' bytes
