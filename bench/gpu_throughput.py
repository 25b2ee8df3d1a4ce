"""GPT-2 medium on one CUDA GPU through pretrain_gpt2.py's own path: tokens/s, model TFLOP/s, MFU, and the
planner's predicted peak memory against torch.cuda.max_memory_allocated.

    python bench/gpu_throughput.py [--iters 30] [--peak-tflops 989] [--only NAME ...] [--profile [NAME ...]]
        [--sdpa flash] [--warmup SECONDS] [--deadline SECONDS]

The configurations run in the order --only names them; --deadline gives the whole run a budget (a configuration
gets what is left, and is skipped under 45 s: --compile's warm-up runs only where it fits), --warmup runs bf16
matrix products first and prints their rate (the GPU's measured ceiling). "llama1b ..." configurations train a
~1B Llama-style model (16 layers, hidden 2048, 32 heads in 8 groups, SwiGLU 8192, RMSNorm, rotary, sequence 2048).

Each configuration is one child process (clean CUDA memory statistics) running `megatron.training.pretrain.run`
as a one-rank job (NCCL, the same path torchrun gives one GPU) with SDPA limited to the flash kernel
(`torch.nn.attention.sdpa_kernel(FLASH_ATTENTION)`): a model that passed an attention mask would fail there.
Data: random token ids over GPT-2's 50257-token vocabulary (a byte-level vocab.json of that size; the ids are
not text, which changes nothing in speed or memory), documents of 512 to 4096 tokens.
MFU = tokens/s x model FLOPs per token / --peak-tflops (H100 SXM dense bf16: 989), the model FLOPs being
megatron/model/flops.py's without recomputation (Megatron's formula, Narayanan et al. 2021, for d = h, f = 4h:
72 B s L h^2 (1 + s/(6h) + V/(12 L h)) per iteration of B sequences; V = 50304, the padded vocabulary); the
"TFLOP/s" column is the training log's, which counts recomputed forwards (hardware FLOPs). tokens/s and TFLOP/s
are the medians of the log intervals after the first (warm-up). Memory: `--log-memory` at iteration 2 prints the measured peak
(torch.cuda.max_memory_allocated) and the planner's prediction for the same flags.

--profile prints, per configuration, the GPU time per category of iterations 12-14 (matrix products, attention
forward / backward, loss, elementwise and norms, copies, the optimizer's step tail, communication) and the GPU's
idle time against the wall clock (bench/profile_categories.py), with the SDPA backend that ran; --sdpa picks the
one kernel allowed (flash, cudnn, efficient, math). The issue-33 rows measure each change: DeepSpeed's own bf16
tail against tds's (`"pipeline": {"flat_bf16_tail": false}`), the fused loss, --compile (give --timeout 600 for
its compilation), both. `--tiny` runs the same on CPU (2 layers), CPU time instead of GPU time.
"""
from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), os.path.pardir))
MEDIUM = ["--num-layers", "24", "--hidden-size", "1024", "--num-attention-heads", "16", "--seq-length", "1024",
          "--max-position-embeddings", "1024"]
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
        "--max-position-embeddings", "128"]
# A Llama-3.2-1B-shaped model (tied head) over GPT-2's vocabulary: ~1.08 B parameters
LLAMA_LAYER = ["--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--group-query-attention",
               "--disable-bias-linear"]
LLAMA_1B = ["--num-layers", "16", "--hidden-size", "2048", "--num-attention-heads", "32", "--num-query-groups", "8",
            "--ffn-hidden-size", "8192", "--seq-length", "2048", "--max-position-embeddings", "2048",
            "--rotary-base", "500000", *LLAMA_LAYER]
TINY_LLAMA = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
              "--ffn-hidden-size", "128", "--seq-length", "128", "--max-position-embeddings", "128", *LLAMA_LAYER]
# name: extra pretrain_gpt2.py flags (a name starting "llama1b" trains LLAMA_1B, any other GPT-2 medium)
CONFIGS = {
    "medium mb8 bf16": ["--micro-batch-size", "8", "--bf16"],
    "medium mb16 bf16": ["--micro-batch-size", "16", "--bf16"],
    "medium mb16 bf16 full recompute": ["--micro-batch-size", "16", "--bf16", "--recompute-granularity", "full"],
    "medium mb16 bf16 selective recompute": ["--micro-batch-size", "16", "--bf16", "--recompute-granularity",
                                             "selective"],
    "medium mb8 fp16": ["--micro-batch-size", "8", "--fp16"],
    # issue 33: each change alone and together, beside the rows above (DeepSpeed's own bf16 tail: TAIL_DS)
    "medium mb16 bf16 deepspeed tail": ["--micro-batch-size", "16", "--bf16", "TAIL_DS"],
    "medium mb16 bf16 fused loss": ["--micro-batch-size", "16", "--bf16", "--cross-entropy-loss-fusion"],
    "medium mb16 bf16 compile": ["--micro-batch-size", "16", "--bf16", "--compile"],
    "medium mb8 bf16 fused loss compile": ["--micro-batch-size", "8", "--bf16", "--cross-entropy-loss-fusion",
                                           "--compile"],
    "medium mb16 bf16 fused loss compile": ["--micro-batch-size", "16", "--bf16", "--cross-entropy-loss-fusion",
                                            "--compile"],
    # issue 45: a ~1B Llama-style model (16,384 tokens per iteration, as GPT-2 medium at micro-batch 16)
    "llama1b mb8 bf16": ["--micro-batch-size", "8", "--bf16"],
    "llama1b mb8 bf16 fused loss": ["--micro-batch-size", "8", "--bf16", "--cross-entropy-loss-fusion"],
}


def model_of(name: str, tiny: bool) -> list:
    if name.startswith("llama1b"):
        return TINY_LLAMA if tiny else LLAMA_1B
    return TINY if tiny else MEDIUM


VOCAB = 50257
LINE = re.compile(r"\| ([0-9.]+) tokens/s \| ([0-9.]+) TFLOP/s/device")
MEMORY = re.compile(r"memory iteration \d+ rank 0 .*: peak ([0-9.]+) MiB = .*predicted ([0-9.]+) MiB \(([-+0-9.]+)%\)")


def write_data(out_dir: str, tokens: int) -> dict:
    """A GPT-2-sized byte-level vocab (256 byte symbols, filler tokens, <|endoftext|>) and random documents."""
    from megatron.data.indexed_dataset import MMapIndexedDatasetBuilder, best_fitting_dtype, data_file_path, \
        index_file_path
    from megatron.tokenizer.bpe_python import bytes_to_unicode
    symbols = list(bytes_to_unicode().values())
    vocab = {s: i for i, s in enumerate(symbols)}
    vocab.update({f"filler{i}": i for i in range(len(symbols), VOCAB - 2)})
    vocab["\u0120t"] = VOCAB - 2  # "Ġt": the result of the one merge (a merges file without merges is refused)
    vocab["<|endoftext|>"] = VOCAB - 1
    paths = dict(vocab=os.path.join(out_dir, "vocab.json"), merges=os.path.join(out_dir, "merges.txt"),
                 data_prefix=os.path.join(out_dir, "random_text_document"))
    with open(paths["vocab"], "w", encoding="utf-8") as f:
        json.dump(vocab, f)
    with open(paths["merges"], "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n\u0120 t\n")
    rng = np.random.default_rng(0)
    builder = MMapIndexedDatasetBuilder(data_file_path(paths["data_prefix"]), dtype=best_fitting_dtype(VOCAB))
    written = 0
    while written < tokens:
        n = int(rng.integers(512, 4097))
        builder.add_item(np.append(rng.integers(0, VOCAB - 1, n), VOCAB - 1))
        builder.end_document()
        written += n + 1
    builder.finalize(index_file_path(paths["data_prefix"]))
    return paths


SDPA = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
        "math": "MATH"}


def child(argv: list) -> None:
    """One run, in this process: one rank, SDPA limited to BENCH_SDPA's kernel (default flash)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from megatron.config.arguments import ENTRY_DEFAULTS
    from megatron.model.specs import spec_for
    from megatron.training.pretrain import run
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"device {name} torch {torch.__version__}", flush=True)
    backends = [getattr(SDPBackend, SDPA[os.environ.get("BENCH_SDPA", "flash")])]
    if not torch.cuda.is_available():  # --tiny on CPU: its flash kernel has no dropout
        backends.append(SDPBackend.MATH)
    with sdpa_kernel(backends), _profiled(os.environ.get("BENCH_PROFILE") == "1", torch.cuda.is_available()):
        run(argv, spec_for("gpt"), ENTRY_DEFAULTS["gpt"])


@contextlib.contextmanager
def _profiled(on: bool, cuda: bool):
    """--profile: torch.profiler and cProfile over iterations 12-14 (each engine.train_batch is a profiler
    step); prints the time per category (bench/profile_categories.py: device time on a GPU, CPU time on CPU)
    with the idle time against the wall clock and the SDPA backend that ran, the operators by GPU time and by
    CPU time, and the Python functions by own and total time."""
    if not on:
        yield
        return
    from profile_categories import format_table, profiled  # bench/ is on the path when this script runs

    from tds.pipe.engine import PipelineEngine
    original = PipelineEngine.train_batch
    python, calls = cProfile.Profile(), [0]

    def train_batch(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 12:
            python.enable()
        out = original(self, *args, **kwargs)
        if calls[0] == 14:
            python.disable()
        return out
    PipelineEngine.train_batch = train_batch
    try:
        with profiled(device=cuda, wait=10, warmup=1, active=3) as result:
            yield
    finally:
        PipelineEngine.train_batch = original
    if result.table is None:
        print("profile: fewer than 14 iterations ran", flush=True)
        return
    print(format_table(result.table, "GPU" if cuda else "CPU"), flush=True)
    print(f"SDPA backend: {result.backend}", flush=True)
    for key in ("device_time_total", "cpu_time_total") if cuda else ("cpu_time_total",):
        print(result.prof.key_averages().table(sort_by=key, row_limit=22, max_name_column_width=60), flush=True)
    pstats.Stats(python, stream=sys.stdout).sort_stats("tottime").print_stats(30)
    pstats.Stats(python, stream=sys.stdout).sort_stats("cumulative").print_stats(40)


def model_flops_per_token(model: list) -> float:
    """megatron/model/flops.py's model FLOPs (no recomputation) per token: GPT-2 (d = h, f = 4h) or the Llama
    layer (grouped-query key/values, SwiGLU's two input projections)."""
    from megatron.model.flops import gpt_flops_per_iteration
    flag = dict((a, b) for a, b in zip(model, model[1:]) if a.startswith("--"))
    s, h, layers = int(flag["--seq-length"]), int(flag["--hidden-size"]), int(flag["--num-layers"])
    f = int(flag.get("--ffn-hidden-size", 4 * h))
    d_kv = h // int(flag["--num-attention-heads"]) * int(flag.get("--num-query-groups", flag["--num-attention-heads"]))
    padded = -(-VOCAB // 128) * 128
    return gpt_flops_per_iteration(1, s, layers, h, h, f, padded, recompute=False, d_kv=d_kv,
                                   gated="--swiglu" in model) / s


def matmul_ceiling(seconds: float) -> None:
    """Warm the GPU up for `seconds` with 8192^3 bf16 products and print their rate (the measured ceiling)."""
    import torch
    if not torch.cuda.is_available():
        return
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    start, n, rate = time.time(), 0, 0.0
    while time.time() - start < seconds:
        t0 = torch.cuda.Event(enable_timing=True)
        t1 = torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(50):
            a @ b
        t1.record()
        t1.synchronize()
        rate = max(rate, 50 * 2 * 8192 ** 3 / (t0.elapsed_time(t1) / 1e3) / 1e12)
        n += 50
    print(f"warm-up: {n} bf16 8192^3 products in {time.time() - start:.1f} s, best 50 at {rate:.0f} TFLOP/s "
          f"({torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda})", flush=True)


def tail_config(folder: str) -> str:
    path = os.path.join(folder, "deepspeed_tail.json")
    with open(path, "w") as f:
        json.dump({"pipeline": {"flat_bf16_tail": False}}, f)
    return path


def job_argv(data: dict, model: list, iters: int, extra: list) -> list:
    return [*model, *extra, "--gas", "1", "--train-iters", str(iters), "--lr", "1.5e-4", "--min-lr", "1e-5",
            "--lr-warmup-iters", "5", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--zero-stage", "1",
            "--data-path", data["data_prefix"], "--vocab-file", data["vocab"], "--merge-file", data["merges"],
            "--tokenizer-type", "GPT2BPETokenizer", "--num-workers", "2", "--log-interval", "5",
            "--eval-iters", "0", "--eval-interval", str(10 ** 6), "--split", "98,1,1", "--log-memory"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100 SXM: 989)")
    p.add_argument("--only", nargs="*", default=None, help="configuration names (default: all)")
    p.add_argument("--timeout", type=float, default=150.0, help="seconds per configuration")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model, to check this script on CPU")
    p.add_argument("--profile", nargs="*", default=None, help="print the time per category (and torch.profiler's "
                   "tables) of iterations 12-14: of every configuration, or of those named")
    p.add_argument("--deadline", type=float, default=None, help="seconds for the whole run: a configuration gets "
                   "what is left (its --timeout at most) and is skipped under 45 s")
    p.add_argument("--warmup", type=float, default=0.0, help="seconds of bf16 matrix products first (the GPU's "
                   "clocks up; prints their rate)")
    p.add_argument("--sdpa", choices=sorted(SDPA), default="flash", help="the one SDPA kernel allowed (default "
                   "flash); run each to pick the fastest")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="pretrain_gpt2.py flags for every run")
    p.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child is not None:
        child(args.child)
        return
    rows, began = [], time.time()
    unknown = sorted(set(args.only or ()) - set(CONFIGS))
    if unknown:
        p.error(f"unknown configuration {unknown[0]!r}; known: {', '.join(CONFIGS)}")
    matmul_ceiling(args.warmup)
    with tempfile.TemporaryDirectory() as tmp:
        tokens = args.iters * 16 * 1025 * 2 + 10 ** 6
        data = write_data(tmp, tokens)
        for name in args.only or CONFIGS:  # in the order given
            extra, model = CONFIGS[name], model_of(name, args.tiny)
            per_token = model_flops_per_token(model)
            timeout = args.timeout
            if args.deadline is not None:
                timeout = min(timeout, args.deadline - (time.time() - began))
                if timeout < 45:
                    print(f"--- {name}: skipped, {timeout:.0f} s left of --deadline", flush=True)
                    rows.append((name, "skipped", "", "", "", "", ""))
                    continue
            profile = args.profile is not None and (not args.profile or name in args.profile)
            if "TAIL_DS" in extra:  # DeepSpeed's BF16_Optimizer tail instead of tds/pipe/bf16_tail.py
                extra = [x for x in extra if x != "TAIL_DS"] + ["--deepspeed_config", tail_config(tmp)]
            cmd = [sys.executable, __file__, "--child", *job_argv(data, model, args.iters, extra + args.extra)]
            env = dict(os.environ, BENCH_PROFILE="1" if profile else "0", BENCH_SDPA=args.sdpa)
            t0 = time.time()
            try:
                proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
                out, code = proc.stdout + proc.stderr, proc.returncode
            except subprocess.TimeoutExpired as err:
                text = lambda b: b.decode(errors="replace") if isinstance(b, bytes) else (b or "")  # noqa: E731
                out, code = text(err.stdout) + text(err.stderr), f"timed out after {timeout:g} s"
            sys.stdout.write(f"--- {name} (exit {code}, {time.time() - t0:.0f} s, model FLOPs per token "
                             f"{per_token:.4g})\n{out[-(60000 if profile else 3000):]}\n")
            sys.stdout.flush()
            rates = [(float(a), float(b)) for a, b in LINE.findall(out)][1:]
            mem = MEMORY.search(out)
            if code or not rates:
                rows.append((name, "failed", "", "", "", "", ""))
                continue
            tok = statistics.median(r[0] for r in rates)
            tfl = statistics.median(r[1] for r in rates)
            mfu = tok * per_token / (args.peak_tflops * 1e12)
            rows.append((name, f"{tok:.0f}", f"{tfl:.1f}", f"{100 * mfu:.1f}%",
                         mem.group(1) if mem else "?", mem.group(2) if mem else "?",
                         f"{mem.group(3)}%" if mem else "?"))
            print("row: | " + " | ".join(rows[-1]) + " |", flush=True)
    print(f"MFU = tokens/s x model FLOPs per token (no recomputation) / {args.peak_tflops:g} TFLOP/s")
    print("| configuration | tokens/s | TFLOP/s (log) | MFU | measured peak MiB | predicted MiB | error |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
