"""Rank functions for run_distributed: parse arguments as an entry point would, then `pretrain`."""
from typing import List, Optional, Sequence

from megatron.config.arguments import parse_args
from megatron.training.loop import TrainState
from megatron.model.specs import ModelSpec
from megatron.training.pretrain import pretrain
from pretrain_gpt2 import DEFAULTS as GPT_DEFAULTS



def small_argv(data: dict, tp: int = 1, pp: int = 1, train_iters: int = 10, extra: Sequence[str] = ()) -> List[str]:
    """A tiny model on the test corpus; micro-batch 2, global batch 8, fp32, ZeRO-1 (from the command line)."""
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", str(train_iters),
            "--lr", "1e-3", "--lr-warmup-iters", "2", "--lr-decay-style", "cosine", "--zero-stage", "1",
            "--data-path", data["data_prefix"], "--vocab-file", data["vocab"], "--merge-file", data["merges"],
            "--num-workers", "0", "--log-interval", "5", "--eval-interval", "5", "--eval-iters", "1",
            "--split", "90,8,2", "--make-vocab-size-divisible-by", "8",
            "--tensor-model-parallel-size", str(tp), "--pipe-parallel-size", str(pp)] + list(extra)


def train_state(argv: Sequence[str], world_size: int, spec: Optional[ModelSpec] = None,
                defaults: Optional[dict] = None) -> TrainState:
    """Run pretrain on this rank (the toy model unless a `spec` is given); returns its TrainState."""
    if spec is None:
        from tests.training.toy_model import TOY_SPEC as spec
    args = parse_args(list(argv), defaults=defaults or GPT_DEFAULTS, world_size=world_size)
    return pretrain(args, spec)


def train_losses(argv: Sequence[str], world_size: int, spec: Optional[ModelSpec] = None,
                 defaults: Optional[dict] = None) -> List[float]:
    """The per-iteration training losses of this run."""
    return train_state(argv, world_size, spec, defaults).losses
