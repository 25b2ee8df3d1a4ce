"""One timeout for every wait of the pipeline engine, and errors that name the stage, the group and the operation.

A rank that dies or stalls must not leave its peers waiting for torch's default 30 minutes. The engine waits in
point-to-point receives (`p2p.py`) and in collectives: the tied-weight and data-parallel gradient all-reduces,
the tensor-parallel all-gather of partitioned activations, the loss all-reduce/broadcast, ZeRO-1's all-gather
and the gradient-norm all-reduce of the optimizer step, and the collectives inside the model's layers. All of
them use one setting:

    pipeline.timeout_s in the DeepSpeed JSON (default 600 s, Megatron's 10 minutes)
    env TDS_TIMEOUT_S overrides it (the engine logs that it did)

The timeout is installed on every process group the engine runs collectives on (`apply_timeout`), so a
collective that waits longer raises; with gloo a dead peer's closed connection raises at once. `CommGuard`
turns such a failure into a `PipelineCommError` naming the stage, the instruction, the group(s) with their
ranks and the operation.
"""
from __future__ import annotations

import contextlib
import datetime
import logging
import os
from typing import Iterator

import torch.distributed as dist

from .p2p import PipelineCommError

DEFAULT_TIMEOUT_S = 600.0
ENV = "TDS_TIMEOUT_S"
_LEGACY_ENV, _LEGACY_KEY = "TDS_P2P_TIMEOUT_S", "p2p_timeout_s"
_COMM_MARKERS = ("gloo", "nccl", "connection reset", "connection closed", "timed out", "broken pipe")

logger = logging.getLogger(__name__)


def resolve_timeout(cfg: dict) -> tuple[float, str]:
    """(seconds, where it came from): env TDS_TIMEOUT_S, else pipeline.timeout_s, else the default.

    The older names pipeline.p2p_timeout_s / TDS_P2P_TIMEOUT_S are read as the same setting."""
    configured = cfg.get("timeout_s", cfg.get(_LEGACY_KEY))
    source = "pipeline.timeout_s" if configured is not None else "default"
    seconds = float(configured) if configured is not None else DEFAULT_TIMEOUT_S
    for env in (ENV, _LEGACY_ENV):
        if os.environ.get(env):
            logger.warning(f"{env}={os.environ[env]} overrides the pipeline timeout ({source}: {seconds:g}s)")
            return float(os.environ[env]), env
    if seconds <= 0:
        raise ValueError(f"pipeline.timeout_s must be > 0 seconds, got {seconds:g}")
    return seconds, source


def apply_timeout(groups: dict, timeout_s: float) -> None:
    """Make every collective on `groups` ({name: ProcessGroup}) fail after `timeout_s` seconds."""
    from torch.distributed.distributed_c10d import _set_pg_timeout
    delta = datetime.timedelta(seconds=timeout_s)
    seen = set()
    for group in groups.values():
        if group is None or id(group) in seen or dist.get_rank(group) < 0:
            continue
        seen.add(id(group))
        _set_pg_timeout(delta, group)


def group_ranks(group) -> list[int]:
    return dist.get_process_group_ranks(group) if group is not None else list(range(dist.get_world_size()))


def is_comm_failure(err: BaseException) -> bool:
    """A failed or timed-out collective/transfer (torch's DistError, or a gloo/NCCL transport error)."""
    if isinstance(err, getattr(dist, "DistError", ())):
        return True
    text = str(err).lower()
    return isinstance(err, RuntimeError) and any(m in text for m in _COMM_MARKERS)


class CommGuard:
    """Names the groups of one engine for error messages; `guard(where, what)` wraps a step."""

    def __init__(self, stage_id: int, timeout_s: float, source: str, groups: dict):
        self.stage_id, self.timeout_s, self.source = stage_id, timeout_s, source
        self.groups = {name: g for name, g in groups.items() if g is not None}

    def describe(self, *names: str) -> str:
        """'the data-parallel group (ranks [1, 3])' for each known name, joined."""
        parts = [f"the {n} group (ranks {group_ranks(self.groups[n])})" for n in names if n in self.groups]
        return " / ".join(parts) if parts else "a process group"

    @contextlib.contextmanager
    def guard(self, where: str, what: str) -> Iterator[None]:
        try:
            yield
        except RuntimeError as err:
            failure = self.failure(err, where, what)
            if failure is None:
                raise
            raise failure from err

    def failure(self, err: BaseException, where: str, what: str) -> PipelineCommError | None:
        """The error to raise for `err` raised in `where` while `what` communicated: None unless `err` is a failed
        or timed-out transfer or collective not yet named (a `PipelineCommError` already is)."""
        if isinstance(err, PipelineCommError) or not is_comm_failure(err):
            return None
        return PipelineCommError(
            f"pipeline stage {self.stage_id} (rank {dist.get_rank()}), {where}: {what} failed or timed out "
            f"after {self.timeout_s:g}s (timeout from {self.source}; set pipeline.timeout_s or {ENV}): "
            f"{_first_line(err)}")


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else type(err).__name__

