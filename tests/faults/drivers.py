"""How a mutated file reaches the project: each driver runs the user's command on a case folder, in this process
(or, for --load, in one spawned gloo process that keeps its engine across cases), and returns what it read, as a
fingerprint to compare with the unmutated run's. A UserError propagates (the command's `error:` line, exit 2);
any other exception is a traceback.

    preflight_and_reads(inputs, folder, kind)   python -m megatron.config.preflight (the example scripts' check
                        before the launch), then what a training process reads before its first step: the
                        tokenizer, the RunConfig (the DeepSpeed JSON merged), the dataset and its token-id check
    tool(argv)          tools/convert_checkpoint.py (reshape, export-hf, import-hf)
    load_cases(...)     pretrain's `--load` (megatron.checkpointing.load_checkpoint) into a built engine
"""
from __future__ import annotations

import dataclasses
import os
import signal
import zlib
from contextlib import contextmanager
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

CASE_TIMEOUT_S = 60


class Hang(Exception):
    """A case ran over CASE_TIMEOUT_S."""


@contextmanager
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


def digest(obj: Any) -> Any:
    """A comparable summary of tensors, arrays and containers (CRC-32 of every tensor's bytes, with dtype and
    shape)."""
    if torch.is_tensor(obj):
        t = obj.detach().cpu().contiguous()
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        return ("tensor", str(t.dtype), tuple(t.shape), zlib.crc32(data))
    if isinstance(obj, np.ndarray):
        return ("array", str(obj.dtype), obj.shape, zlib.crc32(np.ascontiguousarray(obj).tobytes()))
    if isinstance(obj, dict):
        return {k: digest(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [digest(v) for v in obj]
    if isinstance(obj, (int, float, str, bool, type(None))):
        return obj
    return repr(obj)


# ---- preflight and the reads of a training process ------------------------------------------------------------

def tokenizer_fingerprint(tokenizer) -> dict:
    """Every id a training run takes from the tokenizer (it never encodes text: the data is tokenized)."""
    out = dict(vocab_size=tokenizer.vocab_size)
    for name in ("eod", "eos", "pad", "cls", "sep", "mask", "bos", "unk", "sentinel_ids"):
        try:
            out[name] = getattr(tokenizer, name)
        except (AttributeError, NotImplementedError):
            out[name] = None
    return out


def preflight_and_reads(argv: Sequence[str], model: str) -> dict:
    """The example scripts' preflight, then a training process's reads before its first step."""
    from megatron.config import preflight
    from megatron.config.arguments import ENTRY_DEFAULTS, parse_args
    from megatron.config.run_config import settle
    from megatron.config.resolution import with_vocabulary
    from megatron.data.indexed_dataset import MMapIndexedDataset
    from megatron.data.token_ids import check_token_ids, text_limit, vocabulary_limit
    from megatron.model.specs import spec_for
    from megatron.training.pretrain import build_tokenizer_from_args
    preflight.main([model, "--world-size", "1", *argv])
    args = parse_args(list(argv), defaults=ENTRY_DEFAULTS[model], world_size=1)
    preflight.check_inputs(args)  # what every training process checks at its start
    tokenizer = build_tokenizer_from_args(args)
    cfg = settle(with_vocabulary(args, tokenizer.vocab_size), spec_for(model))
    prefix = args.data_path[0]
    data = MMapIndexedDataset(prefix)
    check_token_ids(prefix, data, vocabulary_limit(tokenizer) if model == "gpt" else text_limit(tokenizer))
    tokens = zlib.crc32(b"".join(np.asarray(data[i]).tobytes() for i in range(len(data))))
    return dict(tokenizer=tokenizer_fingerprint(tokenizer), ds_config=digest(cfg.deepspeed_dict()),
                data=(digest(data.sizes), digest(data.doc_idx), tokens, str(data.dtype)))


# ---- the tools --------------------------------------------------------------------------------------------------

def tool(argv: Sequence[str]) -> None:
    """The command line in this process (its report lines are not wanted here)."""
    import contextlib
    import io
    from megatron.checkpointing.cli import run
    from megatron.checkpointing.files import show_progress
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            run(list(argv))
    finally:
        show_progress(False)


def checkpoint_fingerprint(save_dir: str) -> dict:
    """A checkpoint's full weights, optimizer state and engine state, whatever its layout."""
    from megatron.checkpointing.consolidated import read_consolidated
    from megatron.checkpointing.files import checkpoint_folder
    ck = read_consolidated(checkpoint_folder(save_dir), with_optimizer=True)
    return dict(weights=digest(ck.weights), optim=digest(ck.optim), step=digest(ck.step),
                engine=digest({k: v for k, v in ck.engine.items() if k not in ("ds_version",)}))


def hf_fingerprint(folder: str) -> dict:
    from safetensors.torch import load_file
    return digest(load_file(os.path.join(folder, "model.safetensors")))


# ---- --load, in a spawned process that keeps its engine ---------------------------------------------------------

def _engine_state(engine) -> dict:
    import random
    return dict(module=digest(engine.module.state_dict()), optimizer=digest(engine.optimizer.state_dict()),
                scheduler=digest(engine.lr_scheduler.state_dict()), torch_rng=digest(torch.get_rng_state()),
                numpy_rng=digest(np.random.get_state()[1]), python_rng=hash(random.getstate()))


def load_cases(argv: Sequence[str], world_size: int, pristine: str, folders: List[Tuple[str, str]]) -> List[tuple]:
    """Rank function (tests.dist.run_distributed, world size 1): build the engine of `argv` once, load the
    pristine checkpoint, then each (case id, --load folder): (case id, "ok", fingerprint) | (case id,
    "UserError", message) | (case id, "Hang" | exception class, message)."""
    from megatron.checkpointing import load_checkpoint
    from megatron.config.arguments import parse_args
    from megatron.errors import UserError, one_line
    from megatron.training.pretrain import initialize_and_build
    from pretrain_gpt2 import DEFAULTS, SPEC
    args = parse_args(list(argv) + ["--load", pristine], defaults=DEFAULTS, world_size=world_size)
    engine, _, cfg, _ = initialize_and_build(args, SPEC)

    def load(folder: str) -> dict:
        import contextlib
        import io
        run = dataclasses.replace(cfg, checkpoint=dataclasses.replace(cfg.checkpoint, load=folder))
        with contextlib.redirect_stdout(io.StringIO()):
            iteration, consumed = load_checkpoint(engine, run)
        return dict(iteration=iteration, consumed=consumed, state=_engine_state(engine))
    reference = load(pristine)
    out = [("pristine", "ok", reference)]
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


def run_load_cases(argv: Sequence[str], pristine: str, folders: List[Tuple[str, str]]) -> Dict[str, tuple]:
    from tests.dist import run_distributed
    results = run_distributed(load_cases, 1, list(argv), 1, pristine, folders,
                              timeout=120 + CASE_TIMEOUT_S * max(1, len(folders)) // 4)[0]
    return {case: (status, value) for case, status, value in results}


def train_checkpoint(argv: Sequence[str], world_size: int) -> List[float]:
    """Rank function: train and save the campaign's checkpoint (pretrain, as pretrain_gpt2.py does)."""
    from tests.training.runner import train_losses
    from pretrain_gpt2 import DEFAULTS, SPEC
    return train_losses(argv, world_size, SPEC, DEFAULTS)


def ds_engine_case(argv: Sequence[str], world_size: int) -> Optional[str]:
    """Rank function: build the engine of `argv` (a DeepSpeed JSON the preflight accepted); None, or the
    UserError's line; another exception propagates (a traceback)."""
    from megatron.config.arguments import parse_args
    from megatron.errors import UserError, one_line
    from megatron.training.pretrain import initialize_and_build
    from pretrain_gpt2 import DEFAULTS, SPEC
    try:
        initialize_and_build(parse_args(list(argv), defaults=DEFAULTS, world_size=world_size), SPEC)
    except UserError as err:
        return one_line(str(err))
    return None
