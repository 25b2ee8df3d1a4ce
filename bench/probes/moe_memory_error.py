"""The planner's memory error for a mixture of experts: predicted vs measured peak bytes per rank (CPU, gloo).

    python bench/probes/moe_memory_error.py [--only NAME ...]

bench/memory_error.py's protocol and code (its `predict`, `measure`, `report`: iteration 2 measured on gloo ranks
through the training path, the prediction megatron.planning's with CPU's attention), on MoE models:

    moe         tests/planning/test_measured.py's: the Llama layer (4 layers, h 64, s 64, micro-batch 2) with the
                golden MoE model's experts (8, a shared expert of 32, the aux and z losses, an fp64 router), wider
                (96) and top-4, in layers 2-4: the MoE terms are about half of the activations
    golden      tests/training/golden_cases.py's "moe" model itself (2 layers, h 32, s 32, top-2 of 8 experts of
                width 24 in layer 2)

Dropless rows measure balanced routing at initialisation (the planner's dropless assumption); capacity 0.5 fills
every expert (the planner's capacity bound is then exact). Prints the table docs/planner.md quotes.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import tempfile


def _bench_module(name: str):
    """bench/NAME.py, imported from its path (this script lives in bench/probes/)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


base = _bench_module("memory_error")

EXPERTS = ["--num-experts", "8", "--moe-shared-expert-intermediate-size", "32", "--moe-aux-loss-coeff", "0.01",
           "--moe-z-loss-coeff", "0.001", "--moe-router-dtype", "fp64"]
MOE = base.LLAMA + EXPERTS + ["--moe-router-topk", "4", "--moe-ffn-hidden-size", "96", "--moe-layer-freq", "[0,1,1,1]"]
GOLDEN = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
          "--micro-batch-size", "2", "--train-iters", "10", "--make-vocab-size-divisible-by", "8",
          "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
          "--num-query-groups", "2", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
          "--hidden-dropout", "0", "--attention-dropout", "0", *EXPERTS, "--moe-router-topk", "2",
          "--moe-ffn-hidden-size", "24", "--moe-layer-freq", "[0,1]"]
base.MODELS.update({"moe": ("gpt", MOE, base.VOCAB), "golden": ("gpt", GOLDEN, base.VOCAB)})
DP2 = ["--gas", "2", "--zero-stage", "0"]
EP2 = DP2 + ["--expert-model-parallel-size", "2"]
PP2 = ["--gas", "4", "--pipe-parallel-size", "2", "--zero-stage", "0"]
CAPACITY = ["--moe-expert-capacity-factor", "0.5"]
LAYOUTS = {
    "moe dp2 ep1": ("moe", 2, DP2),
    "moe dp2 ep2": ("moe", 2, EP2),
    "moe dp2 ep2 capacity 0.5": ("moe", 2, EP2 + CAPACITY),
    "moe dp2 ep2 alltoall": ("moe", 2, EP2 + ["--moe-token-dispatcher-type", "alltoall"]),
    "moe dp2 ep2 alltoall capacity 0.5": ("moe", 2, EP2 + CAPACITY + ["--moe-token-dispatcher-type", "alltoall"]),
    "moe tp2 sp ep2": ("moe", 2, ["--gas", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
                                  "--zero-stage", "0", "--expert-model-parallel-size", "2"]),
    "moe tp2 sp selective dropout 0.1": ("moe", 2, ["--gas", "2", "--tensor-model-parallel-size", "2",
                                                    "--sequence-parallel", "--zero-stage", "0",
                                                    "--recompute-granularity", "selective", "--hidden-dropout",
                                                    "0.1", "--attention-dropout", "0.1"]),
    "moe pp2 1f1b": ("moe", 2, PP2),
    "moe pp2 zb-h1": ("moe", 2, PP2 + ["--pipeline-schedule", "zb-h1"]),
    "moe pp2 full recompute": ("moe", 2, PP2 + ["--checkpoint-activations"]),
    "moe dp2 zero1 bf16": ("moe", 2, ["--gas", "2", "--zero-stage", "1", "--bf16"]),
    "golden dp2 ep1": ("golden", 2, DP2),
    "golden dp2 ep2": ("golden", 2, EP2),
    "golden dp2 ep2 capacity 0.5": ("golden", 2, EP2 + CAPACITY),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", nargs="*", default=None)
    ap.add_argument("--results", default=os.path.join(os.path.dirname(os.path.dirname(__file__)), "results",
                                                      "moe_memory_error.jsonl"))
    a = ap.parse_args()
    cfg = os.path.join(tempfile.mkdtemp(), "ds.json")
    with open(cfg, "w") as f:
        json.dump({"zero_optimization": {"reduce_bucket_size": base.BUCKET}}, f)
    rows = []
    for name, (model, world, extra) in LAYOUTS.items():
        if a.only and name not in a.only:
            continue
        argv = base.argv_of(model, extra, cfg)
        rows.append(dict(name=name, predicted=base.predict(model, world, argv),
                         measured=base.measure(model, world, argv)))
        print(base.report(rows[-1:]).splitlines()[2], flush=True)
    with open(a.results, "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    print(base.report(rows))


if __name__ == "__main__":
    main()
