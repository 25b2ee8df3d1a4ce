"""Generate text from a checkpoint of this project (GPT-2: continue the prompt; T5: fill the encoder
prompt's sentinels, decoder side).

    python tools/generate.py --load runs/gpt2/checkpoints --prompt "The model" --max-new-tokens 32
    python tools/generate.py --load ckpt --prompt-file prompts.jsonl --json-key text --output out.jsonl \
        --temperature 0.8 --top-p 0.9 --seed 7
    python tools/generate.py --load t5ckpt --prompt "The <extra_id_0> sat on the <extra_id_1>."
    torchrun --nproc_per_node 2 tools/generate.py --load ckpt --tensor-model-parallel-size 2 --prompt ...

Without --prompt / --prompt-file: an interactive prompt when stdin is a terminal, else one prompt per
stdin line. Greedy by default; --temperature / --top-k / --top-p sample (temperature 1 unless given),
from a generator seeded by --seed and the prompt's index: the same text at any tp, dp or batch size.
Each completion stops at end-of-document, a --stop string, --max-new-tokens or the model's positions.
Output: the completions on stdout, or --output FILE.jsonl (prompt, completion, token counts, tokens/s).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import List, Optional

from megatron.errors import UserError, exit_on_user_error
from megatron.inference import GenerationParams, Sampling, generate, loading, parallel
from megatron.inference.generate import encode_prompts
from megatron.inference.progress import Progress
from megatron.inference.prompts import read_prompt_file


def get_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    loading.add_loading_arguments(p)
    g = p.add_argument_group("prompts")
    g.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    g.add_argument("--prompt-file", default=None, help="one prompt per line, or jsonl (see --json-key)")
    g.add_argument("--json-key", default=None, help="field of each jsonl line holding the prompt (default text)")
    g = p.add_argument_group("decoding")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=None, help="sample at this temperature (0 = greedy)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens")
    g.add_argument("--top-p", type=float, default=1.0, help="sample from the smallest set with this probability")
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--stop", action="append", default=[], help="stop a completion at this text (repeatable)")
    g.add_argument("--batch-size", type=int, default=8, help="prompts decoded together")
    g.add_argument("--no-kv-cache", action="store_true", help="recompute the whole sequence every step")
    p.add_argument("--output", default=None, help="write the completions as jsonl here instead of stdout")
    return p.parse_args(argv)


def sampling_of(args: argparse.Namespace) -> Sampling:
    sampling_asked = args.temperature is not None or args.top_k > 0 or args.top_p < 1.0
    temperature = (1.0 if args.temperature is None else args.temperature) if sampling_asked else 0.0
    try:
        return Sampling(temperature, args.top_k, args.top_p)
    except ValueError as err:
        raise UserError(f"--temperature/--top-k/--top-p: {err}") from None


def read_prompts(args: argparse.Namespace) -> Optional[List[str]]:
    """The prompts of --prompt and --prompt-file; None when there are none (interactive / stdin)."""
    prompts = list(args.prompt)
    if args.prompt_file:
        prompts += read_prompt_file(args.prompt_file, args.json_key)
    return prompts or None


def write_jsonl(path: str, records: List[dict]) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, path)


def run_batch(loaded, prompts: List[str], params: GenerationParams, par, output: Optional[str]) -> None:
    start = time.perf_counter()
    progress = Progress(len(prompts), "prompts", enabled=par.is_first and len(prompts) > params.batch_size)
    completions = generate(loaded.model, loaded.tokenizer, prompts, params, par, progress)
    progress.close()
    if not par.is_first:
        return
    seconds = time.perf_counter() - start
    if output:
        write_jsonl(output, [c.record() for c in completions])
    else:
        for n, c in enumerate(completions, 1):
            text = loaded.spec.completion(c.prompt, c.text)
            print(f"== {n}/{len(completions)} ({len(c.ids)} tokens, {c.finish}) ==\n{text}", flush=True)
    new = sum(len(c.ids) for c in completions)
    print(f"{len(completions)} completions, {new} new tokens in {seconds:.2f}s ({new / seconds:.1f} tokens/s)"
          + (f", written to {output}" if output else ""), file=sys.stderr)


def interactive(loaded, params: GenerationParams, par) -> None:
    """Read a prompt on rank 0, generate on every rank; an empty line or end of input quits, a bad prompt is
    reported and asked again."""
    while True:
        text = None
        if par.is_first:
            try:
                text = input("prompt> ")
            except EOFError:
                text = ""
        text = par.broadcast_object(text)
        if not text.strip():
            return
        try:
            run_batch(loaded, [text], params, par, None)
        except UserError as err:  # e.g. a prompt too long: say so and ask again
            if par.is_first:
                print(f"error: {err}", file=sys.stderr)


def main(argv: Optional[List[str]] = None) -> None:
    args = get_args(argv)
    params = GenerationParams(args.max_new_tokens, sampling_of(args), args.seed, tuple(args.stop),
                              args.batch_size, not args.no_kv_cache)
    prompts = read_prompts(args)
    overrides = {k: getattr(args, k) for k in loading.TOKENIZER_FIELDS}
    checkpoint = loading.read_checkpoint(args.load, args.tag, overrides)
    if prompts is not None:
        encode_prompts(checkpoint.config, checkpoint.tokenizer, prompts)  # bad prompts fail before any weight
    with parallel.launched(args.tensor_model_parallel_size) as par:
        loaded = loading.Loaded(checkpoint, loading.load_model(checkpoint, args.load, args.tag, par.tp_group,
                                                               args.dtype, args.trust_checkpoint))
        if prompts is None and par.broadcast_object(sys.stdin.isatty()):  # rank 0's terminal decides
            return interactive(loaded, params, par)
        if prompts is None:
            lines = sys.stdin.read().splitlines() if par.is_first else None
            prompts = [line for line in par.broadcast_object(lines) if line.strip()]
        run_batch(loaded, prompts, params, par, args.output)


if __name__ == "__main__":
    exit_on_user_error(main)
