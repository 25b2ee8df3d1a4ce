"""Megatron's zero-shot evaluations of a GPT-2 checkpoint, offline, on files you bring.

    python tools/evaluate.py --load ckpt --task lm-ppl --data wikitext-103/wiki.test.tokens --overlapping-eval 32
    python tools/evaluate.py --load ckpt --task lambada --data lambada_test.jsonl --strict
    torchrun --nproc_per_node 4 tools/evaluate.py --load ckpt --tensor-model-parallel-size 2 --task ...

lm-ppl: token-level loss and perplexity over windows of the model's sequence length, sliding by
--overlapping-eval (Megatron's default 32), and the adjusted word-level perplexity (exp(loss x token
ratio), WikiText's words counted on the raw file). lambada: exact-match accuracy of the last token, or with
--strict of the whole last word (greedy over all its tokens). Several processes split the work
(data parallel); the result equals one process. Prints one result line; --output FILE.json saves it.
"""
from __future__ import annotations

import argparse
import json
import os
from typing import List, Optional

from megatron.errors import UserError, exit_on_user_error
from megatron.inference import (evaluate_lambada, evaluate_lm, loading, parallel, read_lambada,
                                read_lm_text)
from megatron.inference.detokenize import DETOKENIZERS
from megatron.inference.progress import Progress
from megatron.inference.lm_ppl import windows

TASKS = ("lm-ppl", "lambada")


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    loading.add_loading_arguments(p)
    g = p.add_argument_group("task")
    g.add_argument("--task", choices=TASKS, required=True)
    g.add_argument("--data", required=True, help="lm-ppl: plain text or jsonl; lambada: jsonl {\"text\": ...}")
    g.add_argument("--json-key", default=None, help="field of each jsonl line holding the text (default text)")
    g.add_argument("--seq-length", type=int, default=None, help="window length (default: the checkpoint's)")
    g.add_argument("--overlapping-eval", type=int, default=32, metavar="STRIDE",
                   help="lm-ppl: slide windows by STRIDE tokens, scoring only the last STRIDE (Megatron's default 32)")
    g.add_argument("--detokenize", choices=["auto", *DETOKENIZERS], default="auto",
                   help="lm-ppl: undo WikiText's tokenization first (auto: when the file name contains 'wiki')")
    g.add_argument("--strict", action="store_true", help="lambada: the whole last word is the target (Megatron's "
                                                         "--strict-lambada); default: the last token")
    g.add_argument("--batch-size", type=int, default=8, help="windows / examples per forward pass")
    p.add_argument("--output", default=None, help="also write the result as JSON here")
    return p.parse_args(argv)


def seq_length_of(args: argparse.Namespace, checkpoint) -> int:
    positions = checkpoint.config.max_position_embeddings
    seq = args.seq_length or checkpoint.args.get("seq_length") or positions
    if not 1 <= seq <= positions:
        raise UserError(f"--seq-length {seq} must be between 1 and the model's {positions} positions")
    return seq


def read_data(args: argparse.Namespace, tokenizer):
    """lm-ppl: the tokenized text (LMText); lambada: (context, target) id pairs."""
    if args.task == "lm-ppl":
        return read_lm_text(args.data, tokenizer, args.detokenize, args.json_key)
    return read_lambada(args.data, tokenizer, args.strict, args.json_key or "text")


def run_task(args: argparse.Namespace, model, tokenizer, data, par, seq: int):
    if args.task == "lm-ppl":
        stride = min(args.overlapping_eval, seq)
        progress = Progress(len(windows(max(len(data.tokens), 2), seq, stride)), "windows", par.is_first)
        result = evaluate_lm(model, data, seq, stride, args.batch_size, tokenizer.eod, par, progress)
    else:
        progress = Progress(len(data), "examples", par.is_first)
        result = evaluate_lambada(model, data, seq, args.batch_size, tokenizer.eod, args.strict, par, progress)
    progress.close()
    return result


def main(argv: Optional[List[str]] = None) -> None:
    args = get_args(argv)
    if args.batch_size < 1 or args.overlapping_eval < 1:
        raise UserError(f"--batch-size ({args.batch_size}) and --overlapping-eval ({args.overlapping_eval}) "
                        f"must be >= 1")
    overrides = {k: getattr(args, k) for k in loading.TOKENIZER_FIELDS}
    checkpoint = loading.read_checkpoint(args.load, args.tag, overrides)
    if not checkpoint.spec.zero_shot:
        raise UserError(f"--task {args.task} evaluates a GPT checkpoint; {args.load} is {checkpoint.kind!r}")
    seq = seq_length_of(args, checkpoint)
    data = read_data(args, checkpoint.tokenizer)  # bad data fails before any weight is read
    with parallel.launched(args.tensor_model_parallel_size) as par:
        model = loading.load_model(checkpoint, args.load, args.tag, par.tp_group, args.dtype,
                                   args.trust_checkpoint)
        result = run_task(args, model, checkpoint.tokenizer, data, par, seq)
    if not par.is_first:
        return
    print(f"{result.line()} | {args.data}", flush=True)
    if args.output:
        record = dict(task=args.task, data=args.data, load=args.load, **result.to_dict())
        tmp = f"{args.output}.tmp.{os.getpid()}"
        with open(tmp, "w") as f:
            json.dump(record, f, indent=1)
        os.replace(tmp, args.output)


if __name__ == "__main__":
    exit_on_user_error(main)
