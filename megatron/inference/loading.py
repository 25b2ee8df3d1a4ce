"""A model and its tokenizer from a checkpoint of this project, at the current tensor-parallel size, pp = 1.

    saved = read_checkpoint_args(load_dir, tag)      the resolved training arguments (megatron_args.json)
    config = model_config(saved)                     as the model spec builds it for training
    model = spec.plain(config, tp_group)             then load_model_weights: any saved tp / pp / dp layout
    tokenizer = build_tokenizer(saved tokenizer arguments, or the overrides given here)

Tokenizer files are looked up as saved (absolute, or relative to the current directory); a checkpoint
moved to another machine takes `--vocab-file` / `--merge-file` / `--tokenizer-model` overrides.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional

import torch

from megatron.errors import UserError
from megatron.tokenizer import build_tokenizer

TOKENIZER_FIELDS = ("tokenizer_type", "vocab_file", "merge_file", "tokenizer_model")
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass
class Checkpoint:
    """What a checkpoint's arguments give before any tensor is read."""
    args: Dict[str, Any]  # the saved resolved arguments
    config: Any  # GPTConfig / T5Config
    tokenizer: Any
    where: str

    @property
    def kind(self) -> str:
        return self.args.get("model_type", "gpt")

    @property
    def spec(self):
        """The model family's spec (`megatron.model.specs`)."""
        from megatron.model.specs import spec_for
        return spec_for(self.kind)


@dataclass
class Loaded:
    checkpoint: Checkpoint
    model: torch.nn.Module  # eval mode

    @property
    def tokenizer(self):
        return self.checkpoint.tokenizer

    @property
    def kind(self) -> str:
        return self.checkpoint.kind

    @property
    def spec(self):
        return self.checkpoint.spec


def add_loading_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags every inference tool shares."""
    g = parser.add_argument_group("checkpoint")
    g.add_argument("--load", required=True, help="checkpoint directory (its `latest` tag unless --tag)")
    g.add_argument("--tag", default=None, help="checkpoint tag, e.g. iter_0000200")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1,
                   help="tp size to run at (any; the checkpoint is resharded on load); launch a multiple of it")
    g.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="compute dtype")
    g.add_argument("--trust-checkpoint", action="store_true",
                   help="read the checkpoint's pickles with torch.load(weights_only=False), only for files from a "
                        "source you trust; by default a file needing a global outside the allowlist is refused")
    for name in TOKENIZER_FIELDS:
        g.add_argument("--" + name.replace("_", "-"), default=None,
                       help="override the checkpoint's tokenizer argument")


def build_tokenizer_from(saved: Dict[str, Any], overrides: Dict[str, Optional[str]], where: str):
    """The checkpoint's tokenizer (fields in `overrides` that are not None win); UserError when missing."""
    spec = {k: overrides.get(k) or saved.get(k) for k in TOKENIZER_FIELDS}
    if spec["tokenizer_type"] is None:
        raise UserError(f"checkpoint {where} was saved without a tokenizer argument (tokenizer_type); pass "
                        f"--tokenizer-type with --vocab-file/--merge-file or --tokenizer-model")
    one_file = spec["tokenizer_type"] in ("SentencePieceTokenizer", "HuggingFaceTokenizer")
    needed = ("tokenizer_model",) if one_file else ("vocab_file", "merge_file")
    # a HuggingFaceTokenizer's --tokenizer-model may be the folder holding tokenizer.json
    exists = os.path.exists if spec["tokenizer_type"] == "HuggingFaceTokenizer" else os.path.isfile
    for name in needed:
        path, flag = spec[name], "--" + name.replace("_", "-")
        if overrides.get(name) and not exists(path):
            raise UserError(f"{flag} {path}: no such file")
        if path is None or not exists(path):
            state = "has no" if path is None else f"names {path!r} for"
            raise UserError(f"checkpoint {where} {state} {name} and no such file exists here; pass {flag} FILE")
    try:
        tokenizer = build_tokenizer(spec["tokenizer_type"], spec["vocab_file"], spec["merge_file"],
                                    spec["tokenizer_model"], saved.get("vocab_extra_ids", 0) or 0)
    except (ValueError, FileNotFoundError) as err:
        raise UserError(f"checkpoint {where}: cannot build its tokenizer: {err}") from None
    if saved.get("vocab_size") not in (None, tokenizer.vocab_size):
        raise UserError(f"checkpoint {where} was trained with a vocabulary of {saved['vocab_size']} but the "
                        f"tokenizer files give {tokenizer.vocab_size}; pass the tokenizer it was trained with")
    return tokenizer


def read_checkpoint(load_dir: str, tag: Optional[str] = None,
                    tokenizer_overrides: Optional[Dict[str, Optional[str]]] = None) -> Checkpoint:
    """Arguments, model config and tokenizer of a checkpoint (no weights read: errors come early)."""
    from megatron.checkpointing import read_checkpoint_args
    from megatron.checkpointing.names import model_config
    saved = read_checkpoint_args(load_dir, tag)
    where = load_dir if tag is None else os.path.join(load_dir, tag)
    tokenizer = build_tokenizer_from(saved, tokenizer_overrides or {}, where)
    return Checkpoint(saved, model_config(saved), tokenizer, where)


def load_model(checkpoint: Checkpoint, load_dir: str, tag: Optional[str] = None, tp_group=None,
               dtype: str = "fp32", trust: bool = False) -> torch.nn.Module:
    """GPTModel / T5Model at this tp size with the checkpoint's weights, eval mode; collective over tp. `trust`:
    --trust-checkpoint (tds.safe_load.trusted)."""
    from megatron.checkpointing import load_model_weights
    from tds.safe_load import trusted
    model = checkpoint.spec.plain(checkpoint.config, tp_group)
    with trusted(trust):
        load_model_weights(model, load_dir, tag)
    return model.to(DTYPES[dtype]).eval()


def load(load_dir: str, tag: Optional[str] = None, tp_group=None, dtype: str = "fp32",
         tokenizer_overrides: Optional[Dict[str, Optional[str]]] = None) -> Loaded:
    """Model (eval mode, `dtype`) and tokenizer from a checkpoint; collective over the tp group."""
    checkpoint = read_checkpoint(load_dir, tag, tokenizer_overrides)
    return Loaded(checkpoint, load_model(checkpoint, load_dir, tag, tp_group, dtype))
