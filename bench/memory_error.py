"""The planner's memory error: predicted vs measured peak bytes per rank on small layouts (CPU, gloo).

GPT-2, a GPT with the Llama family's layer (rope, RMSNorm, SwiGLU, grouped-query attention, no biases, untied head)
and T5; the main job's GPT-2 (micro-batch 4, a 2048-token vocabulary) and a GPT-2 so small that the terms every
rank holds whatever the model (communication buffers, the word table's gradient) weigh in its peak.

    python bench/memory_error.py [--only NAME ...] [--results bench/results/memory_error.jsonl] [--report-only]

Protocol: each layout runs as world-size gloo processes (harness/dist.py) through the training path
(`settle` -> `initialize_megatron` -> `setup_engine`, megatron/training/memory_probe.py) on synthetic
micro-batches; iteration 1 warms up (lazily allocated optimizer state), iteration 2 is measured
(megatron/training/memory_log.py: storages live at its start + the allocator profiler's rise). The prediction is
megatron.planning's for the same layout with `attention="math"` (CPU's SDPA). Reported per layout: the worst
rank's measured and predicted peak and the error (predicted - measured) / measured; every rank is compared and
the largest |error| over ranks is shown too. DeepSpeed's ZeRO-1 reduce buckets are set to 1e6 elements
(zero_optimization.reduce_bucket_size) so that its 2 x 5e8-element default does not hide every other part.
Measurements are bytes, not times, so the load on the shared 2-core machine matters little. Gloo frees a
collective's buffers on its own thread, unseen by the profiler: memory_log pairs frees with blocks by address
and counts such a block freed when its address is handed out again (an upper bound).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

GPT = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
       "--micro-batch-size", "2", "--train-iters", "10", "--make-vocab-size-divisible-by", "8"]
T5 = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--encoder-seq-length", "64",
      "--decoder-seq-length", "32", "--micro-batch-size", "2", "--train-iters", "10",
      "--make-vocab-size-divisible-by", "8"]
# the Llama family's layer (rope, RMSNorm, SwiGLU f = 128, 2 key/value groups of 2 heads, no biases, untied head)
# trained as Llama is, without dropout (CPU's SDPA then runs its flash kernel); one row with dropout 0.1
LLAMA = GPT + ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
               "--num-query-groups", "2", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
               "--hidden-dropout", "0", "--attention-dropout", "0"]
# the main job's GPT-2 (examples/ds_pretrain_gpt2.sh on CPU: micro-batch 4, its 2048-token vocabulary), and a GPT-2
# so small (2 layers, h 32, s 32, micro-batch 1) that the terms every rank holds whatever the model dominate its peak
MAIN = GPT + ["--micro-batch-size", "4"]
TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
        "--micro-batch-size", "1", "--train-iters", "10", "--make-vocab-size-divisible-by", "8"]
VOCAB = 1000
# name: (model type, flags, vocabulary)
MODELS = {"gpt": ("gpt", GPT, VOCAB), "t5": ("t5", T5, VOCAB), "llama": ("gpt", LLAMA, VOCAB),
          "main": ("gpt", MAIN, 2048), "tiny": ("gpt", TINY, VOCAB)}
BUCKET = 1_000_000

# name: (model, world size, extra flags)
LAYOUTS = {
    "gpt tp1 pp1 dp1 fp32": ("gpt", 1, ["--gas", "2", "--zero-stage", "0"]),
    "gpt tp2 pp1 dp1 fp32": ("gpt", 2, ["--gas", "2", "--tensor-model-parallel-size", "2", "--zero-stage", "0"]),
    "gpt tp1 pp2 1f1b fp32": ("gpt", 2, ["--gas", "4", "--pipe-parallel-size", "2", "--zero-stage", "0"]),
    "gpt tp1 pp2 dp2 1f1b zero1": ("gpt", 4, ["--gas", "4", "--pipe-parallel-size", "2", "--zero-stage", "1"]),
    "gpt tp2 pp2 1f1b fp32": ("gpt", 4, ["--gas", "4", "--pipe-parallel-size", "2", "--tensor-model-parallel-size",
                                         "2", "--zero-stage", "0"]),
    "gpt pp2 interleaved v2": ("gpt", 2, ["--gas", "4", "--pipe-parallel-size", "2", "--virtual-pipe-stages", "2",
                                          "--zero-stage", "0"]),
    "gpt pp2 zb-h1": ("gpt", 2, ["--gas", "4", "--pipe-parallel-size", "2", "--pipeline-schedule", "zb-h1",
                                 "--zero-stage", "0"]),
    "gpt pp2 full recompute": ("gpt", 2, ["--gas", "4", "--pipe-parallel-size", "2", "--checkpoint-activations",
                                          "--zero-stage", "0"]),
    "gpt dp2 zero1 bf16": ("gpt", 2, ["--gas", "2", "--zero-stage", "1", "--bf16"]),
    "gpt pp2 bf16": ("gpt", 2, ["--gas", "4", "--pipe-parallel-size", "2", "--zero-stage", "0", "--bf16"]),
    "gpt dp2 zero0 fp32": ("gpt", 2, ["--gas", "2", "--zero-stage", "0"]),
    "gpt tp2 pp2 dp2 zero1": ("gpt", 8, ["--gas", "4", "--pipe-parallel-size", "2", "--tensor-model-parallel-size",
                                         "2", "--zero-stage", "1"]),
    "t5 tp1 pp1 dp1 fp32": ("t5", 1, ["--gas", "2", "--zero-stage", "0"]),
    "t5 tp2 pp1 dp1 fp32": ("t5", 2, ["--gas", "2", "--tensor-model-parallel-size", "2", "--zero-stage", "0"]),
    "t5 tp1 pp2 1f1b fp32": ("t5", 2, ["--gas", "4", "--pipe-parallel-size", "2", "--zero-stage", "0"]),
    "t5 tp1 pp2 dp2 zero1": ("t5", 4, ["--gas", "4", "--pipe-parallel-size", "2", "--zero-stage", "1"]),
    "t5 pp2 bf16": ("t5", 2, ["--gas", "4", "--pipe-parallel-size", "2", "--zero-stage", "0", "--bf16"]),
    "t5 dp2 zero1 bf16": ("t5", 2, ["--gas", "2", "--zero-stage", "1", "--bf16"]),
    # sequence parallelism and Megatron's recomputation flags (branch seqpar); skipped where the parser lacks them
    "gpt tp2 sp": ("gpt", 2, ["--gas", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                              "--zero-stage", "0"]),
    "gpt tp2 selective": ("gpt", 2, ["--gas", "2", "--tensor-model-parallel-size", "2", "--recompute-granularity",
                                     "selective", "--zero-stage", "0"]),
    "gpt tp2 pp2 sp selective zb-h1": ("gpt", 4, ["--gas", "4", "--tensor-model-parallel-size", "2",
                                                  "--pipe-parallel-size", "2", "--sequence-parallel",
                                                  "--recompute-granularity", "selective", "--pipeline-schedule",
                                                  "zb-h1", "--zero-stage", "0"]),
    "gpt tp2 pp2 sp selective 1f1b": ("gpt", 4, ["--gas", "4", "--tensor-model-parallel-size", "2",
                                                 "--pipe-parallel-size", "2", "--sequence-parallel",
                                                 "--recompute-granularity", "selective", "--zero-stage", "0"]),
    "gpt pp2 full block": ("gpt", 2, ["--gas", "4", "--pipe-parallel-size", "2", "--recompute-granularity", "full",
                                      "--recompute-method", "block", "--recompute-num-layers", "1",
                                      "--zero-stage", "0"]),
    "t5 tp2 sp": ("t5", 2, ["--gas", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                            "--zero-stage", "0"]),
    # the Llama family's GPT layer (issue 32)
    "llama tp1 pp1 dp1 fp32": ("llama", 1, ["--gas", "2", "--zero-stage", "0"]),
    "llama tp2 pp1 dp1 fp32": ("llama", 2, ["--gas", "2", "--tensor-model-parallel-size", "2", "--zero-stage", "0"]),
    "llama tp1 pp2 1f1b fp32": ("llama", 2, ["--gas", "4", "--pipe-parallel-size", "2", "--zero-stage", "0"]),
    "llama dp2 zero1 bf16": ("llama", 2, ["--gas", "2", "--zero-stage", "1", "--bf16"]),
    "llama tp2 sp": ("llama", 2, ["--gas", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--zero-stage", "0"]),
    "llama pp2 zb-h1": ("llama", 2, ["--gas", "4", "--pipe-parallel-size", "2", "--pipeline-schedule", "zb-h1",
                                     "--zero-stage", "0"]),
    "llama tp2 selective": ("llama", 2, ["--gas", "2", "--tensor-model-parallel-size", "2",
                                         "--recompute-granularity", "selective", "--zero-stage", "0"]),
    "llama tp2 dropout 0.1": ("llama", 2, ["--gas", "2", "--tensor-model-parallel-size", "2", "--hidden-dropout", "0.1",
                                           "--attention-dropout", "0.1", "--zero-stage", "0"]),
    # issue 33: the fused loss (the logits saved in their dtype), --compile (the planner does not model inductor)
    "gpt pp2 bf16 fused loss": ("gpt", 2, ["--gas", "4", "--pipe-parallel-size", "2", "--zero-stage", "0", "--bf16",
                                           "--cross-entropy-loss-fusion"]),
    "gpt dp2 zero1 fused loss": ("gpt", 2, ["--gas", "2", "--zero-stage", "1", "--cross-entropy-loss-fusion"]),
    "llama tp2 fused loss": ("llama", 2, ["--gas", "2", "--tensor-model-parallel-size", "2", "--zero-stage", "0",
                                          "--cross-entropy-loss-fusion"]),
    "gpt pp2 compile": ("gpt", 2, ["--gas", "4", "--pipe-parallel-size", "2", "--zero-stage", "0", "--compile"]),
    "gpt h128 tp2 pp2 sp selective zb-h1": ("gpt", 4, ["--hidden-size", "128", "--gas", "4",
                                                       "--tensor-model-parallel-size", "2", "--pipe-parallel-size", "2",
                                                       "--sequence-parallel", "--recompute-granularity", "selective",
                                                       "--pipeline-schedule", "zb-h1", "--zero-stage", "0"]),
    # issue 40: the main job's layout (its model, ZeRO-1, the fused loss, weight decay and clipping as it runs),
    # sequence parallelism + selective recomputation + ZB-H1 on that GPT-2, and a GPT-2 whose fixed terms dominate
    "main job tp2 pp2 dp2 zero1": ("main", 8, ["--gas", "2", "--tensor-model-parallel-size", "2",
                                               "--pipe-parallel-size", "2", "--zero-stage", "1",
                                               "--cross-entropy-loss-fusion", "--weight-decay", "0.01",
                                               "--clip-grad", "1.0"]),
    "main tp2 pp2 sp selective zb-h1": ("main", 4, ["--gas", "4", "--tensor-model-parallel-size", "2",
                                                    "--pipe-parallel-size", "2", "--sequence-parallel",
                                                    "--recompute-granularity", "selective", "--pipeline-schedule",
                                                    "zb-h1", "--zero-stage", "0"]),
    "tiny tp1 pp1 dp1 fp32": ("tiny", 1, ["--gas", "2", "--zero-stage", "0"]),
    "tiny tp2 pp2 dp2 zero1": ("tiny", 8, ["--gas", "4", "--tensor-model-parallel-size", "2", "--pipe-parallel-size",
                                           "2", "--zero-stage", "1"]),
    "tiny tp2 pp2 sp selective zb-h1": ("tiny", 4, ["--gas", "4", "--tensor-model-parallel-size", "2",
                                                    "--pipe-parallel-size", "2", "--sequence-parallel",
                                                    "--recompute-granularity", "selective", "--pipeline-schedule",
                                                    "zb-h1", "--zero-stage", "0"]),
}


def available(extra) -> bool:
    """Whether this checkout's parser has every flag of `extra`."""
    from megatron.config.arguments import build_parser
    known = build_parser()._option_string_actions
    return all(a in known for a in extra if a.startswith("--"))


def argv_of(model: str, extra, ds_config: str) -> list:
    return MODELS[model][1] + list(extra) + ["--deepspeed_config", ds_config]


def predict(model: str, world: int, argv) -> list:
    """Per pipeline stage, the planner's peak per rank (bytes)."""
    from megatron.training.memory_probe import predicted_peaks
    return predicted_peaks(argv, world, MODELS[model][0], MODELS[model][2])


def measure(model: str, world: int, argv) -> list:
    from megatron.training.memory_probe import measure_rank
    from harness.dist import run_distributed
    out = run_distributed(measure_rank, world, list(argv), world, MODELS[model][0], MODELS[model][2], timeout=1500)
    return [dict(tp=r["tp_rank"], pp=r["pp_rank"], dp=r["dp_rank"], peak=r["peak"].peak,
                 parts=dict(parameters=r["peak"].parameters, gradients=r["peak"].gradients,
                            optimizer=r["peak"].optimizer, other=r["peak"].other, rise=r["peak"].rise)) for r in out]


def report(rows: list) -> str:
    lines = ["| layout | ranks | measured peak, worst rank (MiB) | predicted (MiB) | error | max abs error over ranks |",
             "|---|---|---|---|---|---|"]
    errors = []
    for r in rows:
        pred = r["predicted"]
        per_rank = [(m["peak"], pred[m["pp"]]) for m in r["measured"]]
        worst_m = max(m for m, _ in per_rank)
        worst_p = max(pred)
        err = (worst_p - worst_m) / worst_m
        max_abs = max(abs(p - m) / m for m, p in per_rank)
        errors.append(abs(err))
        lines.append(f"| {r['name']} | {len(per_rank)} | {worst_m / 2**20:.2f} | {worst_p / 2**20:.2f} | {err:+.1%} | "
                     f"{max_abs:.1%} |")
    if errors:
        lines.append(f"\n{len(errors)} layouts: median |error| {statistics.median(errors):.1%}, largest "
                     f"{max(errors):.1%} (worst rank); goal: all within 10%, median within 5%.")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--results", default=os.path.join(os.path.dirname(__file__), "results", "memory_error.jsonl"))
    ap.add_argument("--report-only", action="store_true")
    a = ap.parse_args()
    os.makedirs(os.path.dirname(a.results), exist_ok=True)
    done = {}
    if os.path.exists(a.results):
        with open(a.results) as f:
            for line in f:
                row = json.loads(line)
                done[row["name"]] = row
    cfg = os.path.join(tempfile.mkdtemp(), "ds.json")
    with open(cfg, "w") as f:
        json.dump({"zero_optimization": {"reduce_bucket_size": BUCKET}}, f)
    for name, (model, world, extra) in LAYOUTS.items():
        if a.report_only or (a.only and name not in a.only) or (a.only is None and name in done) \
                or not available(extra):
            continue
        argv = argv_of(model, extra, cfg)
        row = dict(name=name, model=model, world=world, argv=extra, measured=measure(model, world, argv))
        with open(a.results, "a") as f:
            f.write(json.dumps(row) + "\n")
        done[name] = row
        print(f"measured {name}", file=sys.stderr, flush=True)
    rows = []
    for name, (model, world, extra) in LAYOUTS.items():
        if name in done:
            row = dict(done[name])
            row["predicted"] = predict(model, world, argv_of(model, extra, cfg))
            rows.append(row)
    print(report(rows))


if __name__ == "__main__":
    main()
