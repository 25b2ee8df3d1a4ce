"""Build a layout's engine from a command line and measure one training iteration's peak memory on this rank.

For `bench/memory_error.py` and the planner's tests: no data files and no tokenizer (synthetic micro-batches of
`vocab_size` tokens); the same `settle` -> `initialize_megatron` -> `setup_engine` path as `pretrain`.
"""
from __future__ import annotations

from typing import Sequence

from megatron.config.arguments import ENTRY_DEFAULTS, parse_args
from megatron.config.resolution import with_vocabulary
from megatron.config.run_config import settle
from megatron.model.specs import spec_for
from megatron.training.initialize import initialize_megatron
from megatron.training.memory_log import measure_engine
from megatron.training.pretrain import set_deepspeed_verbosity, setup_engine


def measure_rank(argv: Sequence[str], world_size: int, model_type: str, vocab_size: int) -> dict:
    """On one rank of `world_size` (torch.distributed initialised): {'tp_rank', 'pp_rank', 'dp_rank', 'peak'}."""
    spec = spec_for(model_type)
    args = parse_args(list(argv), defaults=ENTRY_DEFAULTS[model_type], world_size=world_size)
    cfg = settle(with_vocabulary(args, vocab_size), spec)
    state = initialize_megatron(cfg)
    set_deepspeed_verbosity(False)
    engine = setup_engine(cfg, spec, state)
    peak = measure_engine(engine, cfg, spec, state.tp_group)
    return dict(tp_rank=state.tp_rank, pp_rank=state.pp_rank, dp_rank=state.dp_rank, peak=peak)


def predicted_peaks(argv: Sequence[str], world_size: int, model_type: str, vocab_size: int) -> list:
    """The planner's peak per rank for each pipeline stage of this command line, with CPU's attention path."""
    from megatron.planning.search import plan_for_args
    args = parse_args(list(argv), defaults=ENTRY_DEFAULTS[model_type], world_size=world_size)
    own, _ = plan_for_args(args, vocab_size, 1e9, attention="math")
    return [s.peak for s in own.stages]
