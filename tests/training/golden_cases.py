"""The golden-loss runs: GPT-2, the Llama-style GPT (`LLAMA`: rope, RMSNorm, SwiGLU, 2 query groups of 2 heads, no
biases, untied head; through pretrain_gpt2.py), Qwen3's layer (`QWEN3`: LLAMA with per-head query / key norms and heads
of width 12, not h / a), OLMo-2's (`OLMO2`: LLAMA with an RMSNorm over all heads' queries and keys, and the norms after
the sublayers), a mixture of experts (`MOE`: LLAMA with experts in its second layer) and T5, 20 iterations, fp32, dropout off, ZeRO-1, global batch 8, gradient
clipping at 0.3 (active: the norms are ~0.6), on the committed corpus and tokenizer in tests/golden/data
(so the data does not depend on the Python version or the tokenizers library). The (1, 1, 1) losses are stored in
tests/golden/{model}_losses.json.

Regenerate (after an intended numerical change, with the reason in the commit message; name models to write only
theirs):

    .venv/bin/python -m tests.training.golden_cases [MODEL ...]
"""
import json
import os
import subprocess
import sys
from typing import List, Sequence, Tuple

from harness.dist import run_distributed
from tests.training.runner import train_state

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GOLDEN = os.path.join(ROOT, "tests", "golden")
DATA = os.path.join(GOLDEN, "data")
ITERS = 20
MODELS = ("gpt2", "llama", "t5", "qwen3", "olmo2", "moe")
LLAMA = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
         "--num-query-groups", "2", "--disable-bias-linear", "--untie-embeddings-and-output-weights"]
QWEN3 = [*LLAMA, "--qk-layernorm", "--kv-channels", "12"]
OLMO2 = [*LLAMA, "--qk-layernorm-full", "--post-sublayer-norm"]
# LLAMA with its second layer a mixture of 8 SwiGLU experts of width 24 (top-2, a shared expert of width 32, the aux
# and z losses, an fp64 router so that no last-bit difference flips a choice)
MOE = [*LLAMA, "--num-experts", "8", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "24",
       "--moe-shared-expert-intermediate-size", "32", "--moe-aux-loss-coeff", "0.01", "--moe-z-loss-coeff", "0.001",
       "--moe-router-dtype", "fp64", "--moe-layer-freq", "[0,1]"]
GPT_LAYERS = {"gpt2": [], "llama": LLAMA, "qwen3": QWEN3, "olmo2": OLMO2, "moe": MOE}  # the GPT layer of each GPT model's flags


def preprocess(out_dir: str) -> str:
    """Tokenize the committed corpus with the committed tokenizer; returns the dataset prefix."""
    prefix = os.path.join(out_dir, "golden")
    subprocess.run([sys.executable, "tools/preprocess_data.py", "--input", os.path.join(DATA, "corpus.jsonl"),
                    "--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", os.path.join(DATA, "vocab.json"),
                    "--merge-file", os.path.join(DATA, "merges.txt"), "--append-eod", "--output-prefix", prefix,
                    "--workers", "1"], cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return prefix + "_text_document"


def argv(model: str, data_prefix: str, tp: int, pp: int, iters: int = ITERS, extra_ids: int = 8,
         intervals: Tuple[int, int, int] = (10, 10, 1), extra: Sequence[str] = ()) -> List[str]:
    """The golden runs' small model; `intervals` = (log, eval, eval iterations)."""
    log_interval, eval_interval, eval_iters = intervals
    shape = (["--encoder-seq-length", "32", "--decoder-seq-length", "16", "--vocab-extra-ids", str(extra_ids)]
             if model == "t5" else ["--seq-length", "32", *GPT_LAYERS[model]])
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", *shape,
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(iters),
            "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--clip-grad", "0.3",
            "--zero-stage", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
            "--tokenizer-type", "GPT2BPETokenizer", "--data-path", data_prefix,
            "--vocab-file", os.path.join(DATA, "vocab.json"), "--merge-file", os.path.join(DATA, "merges.txt"),
            "--num-workers", "0", "--log-interval", str(log_interval), "--eval-interval", str(eval_interval),
            "--eval-iters", str(eval_iters), "--split", "90,8,2", "--make-vocab-size-divisible-by", "8",
            "--tensor-model-parallel-size", str(tp), "--pipe-parallel-size", str(pp), *extra]


def rank_run(model: str, args: List[str], world_size: int) -> Tuple[List[float], List[float]]:
    if model == "t5":
        from pretrain_t5 import DEFAULTS, SPEC
    else:
        from pretrain_gpt2 import DEFAULTS, SPEC
    state = train_state(args, world_size, SPEC, DEFAULTS)
    return state.losses, state.grad_norms


def run(model: str, data_prefix: str, tp: int, pp: int, dp: int,
        extra: Sequence[str] = ()) -> Tuple[List[float], List[float]]:
    """(per-iteration losses, grad norms before clipping) of the last rank; `extra` flags appended."""
    world = tp * pp * dp
    return run_distributed(rank_run, world, model, argv(model, data_prefix, tp, pp, extra=extra), world,
                           timeout=300)[-1]


def golden_path(model: str) -> str:
    return os.path.join(GOLDEN, f"{model}_losses.json")


def main(models: Sequence[str] = MODELS) -> None:
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        prefix = preprocess(tmp)
        for model in models:
            losses, _ = run(model, prefix, 1, 1, 1)
            record = dict(layout="(tp, pp, dp) = (1, 1, 1)", iterations=ITERS, losses=losses,
                          regenerate=".venv/bin/python -m tests.training.golden_cases",
                          args=argv(model, "<tmp>/golden_text_document", 1, 1))
            with open(golden_path(model), "w") as f:
                json.dump(record, f, indent=1)
            print(f"wrote {golden_path(model)}")


if __name__ == "__main__":
    main(sys.argv[1:] or MODELS)
