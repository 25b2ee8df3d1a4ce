"""How a mutated file reaches the project: each command runs in its case folder (the working directory), on
relative paths, and returns its result (harness/faults/results.py) to compare with the pristine run's. A UserError
propagates (the command's `error:` line, exit 2); any other exception is a traceback.

    steps(command, run_as, texts)    the command in this process, as (step, function) pairs:
        preflight + reads   python -m megatron.config.preflight (the example scripts' check before the launch),
                            then what a training process reads before its first step: the tokenizer, the
                            RunConfig (the DeepSpeed JSON merged), the dataset and its token-id check
        reshape, export-hf, import-hf   tools/convert_checkpoint.py; the result is every file it wrote
    through_command(command, run_as) the same command line for a subprocess (preflight + reads: the preflight)
    run_load_cases(...)              pretrain's `--load` (megatron.checkpointing.load_checkpoint) into one built
                                     engine, in one spawned gloo process
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import signal
import sys
import zlib
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import numpy as np
import torch

from harness import ROOT
from harness.faults.results import config_result, digest, folder_result, tokenizer_result

CASE_TIMEOUT_S = 60
DATA = os.path.join("data", "docs_text_document")
OUT = "out"  # where a tool writes, inside the case folder
MODEL = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--micro-batch-size", "2",
         "--global-batch-size", "4", "--train-iters", "4", "--lr", "1e-3", "--num-workers", "0", "--eval-iters", "0",
         "--make-vocab-size-divisible-by", "8", "--seed", "1234"]
GPT = ["--seq-length", "32", "--max-position-embeddings", "32"]
T5 = ["--encoder-seq-length", "32", "--decoder-seq-length", "16", "--max-position-embeddings", "32",
      "--ffn-hidden-size", "64", "--kv-channels", "8", "--vocab-extra-ids", "8"]
BPE = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", "bpe/vocab.json", "--merge-file", "bpe/merges.txt"]
TOOLS = {"reshape": ["reshape", "--load", "ckpt", "--save", OUT, "--tensor-model-parallel-size", "2",
                     "--pipe-parallel-size", "1"],
         "export-hf": ["export-hf", "--load", "ckpt", "--output", OUT],
         "import-hf": ["import-hf", "--input", "export", "--save", OUT, "--tensor-model-parallel-size", "1",
                       "--pipe-parallel-size", "1"]}


class Hang(Exception):
    """A case ran over CASE_TIMEOUT_S."""


@contextlib.contextmanager
def time_limit(seconds: int = CASE_TIMEOUT_S) -> Iterator[None]:
    """SIGALRM raises Hang in the main thread after `seconds`."""
    def expired(signum, frame):
        raise Hang(f"no result after {seconds} s")
    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@contextlib.contextmanager
def working_directory(folder: str) -> Iterator[None]:
    previous = os.getcwd()
    os.chdir(folder)
    try:
        yield
    finally:
        os.chdir(previous)


def gpt_argv(tokenizer: str = "bpe", extra: Sequence[str] = ()) -> List[str]:
    """pretrain_gpt2.py's arguments on the case folder's files (relative to it)."""
    tok = {"bpe": BPE, "hf": ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", "hf/tokenizer.json"]}
    return MODEL + GPT + tok[tokenizer] + ["--data-path", DATA, *extra]


def reads_argv(run_as: str) -> Tuple[str, List[str]]:
    """(model, arguments) of the reads: GPT-2 on the BPE files (with the DeepSpeed JSON: gpt-ds), on tokenizer.json
    (gpt-hf), or T5 on the SentencePiece model."""
    if run_as == "t5":
        return "t5", MODEL + T5 + ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", "spm/spm.model",
                                   "--data-path", DATA]
    extra = ["--deepspeed", "--deepspeed_config", "ds.json"] if run_as == "gpt-ds" else []
    return "gpt", gpt_argv("hf" if run_as == "gpt-hf" else "bpe", extra)


# ---- the commands in this process ------------------------------------------------------------------------------

def preflight(model: str, argv: Sequence[str]) -> None:
    from megatron.config import preflight as check
    check.main([model, "--world-size", "1", *argv])


def reads(model: str, argv: Sequence[str], texts: Sequence[str]) -> dict:
    """What a training process reads before its first step: its tokenizer (ids of `texts`), its RunConfig, its
    data."""
    from megatron.config import preflight as check
    from megatron.config.arguments import ENTRY_DEFAULTS, parse_args
    from megatron.data.indexed_dataset import MMapIndexedDataset
    from megatron.data.token_ids import check_token_ids, text_limit, vocabulary_limit
    from megatron.model.specs import spec_for
    from megatron.training.pretrain import settle_config
    args = parse_args(list(argv), defaults=ENTRY_DEFAULTS[model], world_size=1)
    check.check_inputs(args)  # what every training process checks at its start
    cfg, tokenizer = settle_config(args, spec_for(model))
    prefix = args.data_path[0]
    data = MMapIndexedDataset(prefix)
    check_token_ids(prefix, data, vocabulary_limit(tokenizer) if model == "gpt" else text_limit(tokenizer))
    tokens = zlib.crc32(b"".join(np.asarray(data[i]).tobytes() for i in range(len(data))))
    return dict(tokenizer=tokenizer_result(tokenizer, texts), config=config_result(cfg),
                data=dict(sizes=digest(data.sizes), doc_idx=digest(data.doc_idx), tokens=tokens, dtype=str(data.dtype)))


def tool(argv: Sequence[str]) -> None:
    """tools/convert_checkpoint.py's command line in this process (its report lines are not wanted here)."""
    from megatron.checkpointing.cli import run
    from megatron.checkpointing.files import show_progress
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            run(list(argv))
    finally:
        show_progress(False)


def steps(command: str, run_as: str, texts: Sequence[str]) -> List[Tuple[str, Callable[[], Any]]]:
    """The command in this process, run in the case folder: (step, function) pairs; the last one's value is the
    result."""
    if command == "preflight + reads":
        model, argv = reads_argv(run_as)
        return [("preflight", lambda: preflight(model, argv)), ("reads", lambda: reads(model, argv, texts))]
    return [(command, lambda: (tool(TOOLS[command]), folder_result(OUT))[1])]


def through_command(command: str, run_as: str) -> Tuple[List[str], str]:
    """(argv, step) of the user's command in a subprocess, and which of `steps` it covers."""
    if command == "preflight + reads":
        model, argv = reads_argv(run_as)
        return [sys.executable, "-m", "megatron.config.preflight", model, "--world-size", "1", *argv], "preflight"
    return [sys.executable, os.path.join(ROOT, "tools", "convert_checkpoint.py"), *TOOLS[command]], command


# ---- --load, in a spawned process that keeps its engine ---------------------------------------------------------

def _engine_state(engine) -> dict:
    import random
    return dict(module=digest(engine.module.state_dict()), optimizer=digest(engine.optimizer.state_dict()),
                scheduler=digest(engine.lr_scheduler.state_dict()), torch_rng=digest(torch.get_rng_state()),
                numpy_rng=digest(np.random.get_state()[1]), python_rng=hash(random.getstate()))


def load_cases(argv: Sequence[str], world_size: int, pristine: str, folders: List[Tuple[str, str]]) -> List[tuple]:
    """Rank function (harness.dist.run_distributed, world size 1): build the engine of `argv` once in the pristine
    folder, load its checkpoint twice (the results must agree), then in each (case id, case folder): (case id, "ok",
    result) | (case id, "UserError", line) | (case id, "Hang" | exception class, message)."""
    from megatron.checkpointing import load_checkpoint
    from megatron.config.arguments import ENTRY_DEFAULTS, parse_args
    from megatron.errors import UserError, one_line
    from megatron.model.specs import spec_for
    from megatron.training.pretrain import initialize_and_build
    os.chdir(pristine)
    args = parse_args(list(argv) + ["--load", "ckpt"], defaults=ENTRY_DEFAULTS["gpt"], world_size=world_size)
    engine, _, cfg, _ = initialize_and_build(args, spec_for("gpt"))  # as pretrain_gpt2.py builds it

    def load(folder: str) -> dict:
        os.chdir(folder)
        run = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load="ckpt"))
        with contextlib.redirect_stdout(io.StringIO()):
            iteration, consumed = load_checkpoint(engine, run)
        return dict(iteration=iteration, consumed=consumed, state=_engine_state(engine))
    reference = load(pristine)
    out = [("pristine", "ok", reference), ("pristine again", "ok", load(pristine))]
    for case, folder in folders:
        try:
            with time_limit():
                got = load(folder)
            out.append((case, "ok", got))
        except UserError as err:
            out.append((case, "UserError", one_line(str(err))))
        except Exception as err:  # noqa: BLE001 - the campaign counts it as a traceback
            out.append((case, type(err).__name__, one_line(str(err))[:300]))
        if out[-1][1] != "ok" or out[-1][2] != reference:
            load(pristine)  # a failed or different load may have changed part of the engine's state
    return out


def run_load_cases(pristine: str, folders: List[Tuple[str, str]]) -> Dict[str, tuple]:
    from harness.dist import run_distributed
    results = run_distributed(load_cases, 1, gpt_argv(extra=["--zero-stage", "1"]), 1, pristine, folders,
                              timeout=120 + CASE_TIMEOUT_S * max(1, len(folders)) // 4)[0]
    return {case: (status, value) for case, status, value in results}


def train_checkpoint(argv: Sequence[str], world_size: int, folder: str) -> List[float]:
    """Rank function: in `folder`, train and save the campaign's checkpoint (pretrain, as pretrain_gpt2.py does)."""
    from megatron.config.arguments import ENTRY_DEFAULTS, parse_args
    from megatron.model.specs import spec_for
    from megatron.training.pretrain import pretrain
    os.chdir(folder)
    args = parse_args(list(argv), defaults=ENTRY_DEFAULTS["gpt"], world_size=world_size)
    return pretrain(args, spec_for("gpt")).losses
