"""Point-to-point transport between adjacent pipeline stages: non-blocking sends, receives with a timeout.

Sends are `isend`s that are only waited on at the end of a batch (or when they are already complete), so a
send never blocks the sender; receives wait at most `timeout_s` seconds. With those two rules a schedule is
deadlock-free exactly when `schedule.simulate` runs it to the end (tested there). A peer that dies or hangs
makes the waiting rank raise `PipelineCommError` naming the stage, the instruction (with its micro-batch)
and the peer rank instead of hanging. The transport runs on the pipeline group (the stages of one
pipeline, as Megatron's point-to-point): its peers are the neighbouring stages, and every wait has its own
timeout. It shares that group with the engine's end-of-batch collectives (loss broadcast, timeline), which
start only after `wait_sends`, so no collective on it overlaps a transfer.
"""
from __future__ import annotations

import datetime
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class PipelineCommError(RuntimeError):
    """A pipeline send or receive failed or timed out."""


@dataclass
class P2PStats:
    """Message counts and bytes, split into layout (header) messages and payloads: the shape-exchange cost.
    Headers are counted by the sender (a receiver cannot tell before the message arrives)."""
    header_msgs: int = 0
    header_bytes: int = 0
    payload_msgs: int = 0
    payload_bytes: int = 0
    recv_wait_s: float = 0.0

    def reset(self) -> None:
        self.__init__()


@dataclass
class P2P:
    """Sends and receives of one rank over `group` (the pipeline group; peers are global ranks);
    `stage_id` and `what` (the instruction, formatted only when an error names it) feed error messages."""
    stage_id: int
    timeout_s: float
    group: object
    pending: list = field(default_factory=list)
    stats: P2PStats = field(default_factory=P2PStats)
    batches_done: int = 0  # how often `wait_sends` ran: a send of an earlier generation has completed
    _group_rank: dict = field(default_factory=dict, repr=False)  # global rank -> rank in `group`

    def _peer(self, peer: int) -> tuple:
        """(process group, `peer`'s rank in it). Transfers call the group's own send / recv, as dist.isend and
        dist.irecv do after checks that hold for every hop (~15 us per call on a shared 2-core CPU)."""
        group = self.group if self.group is not None else dist.group.WORLD
        if peer not in self._group_rank:
            self._group_rank[peer] = dist.get_group_rank(group, peer)
        return group, self._group_rank[peer]

    def _count(self, t: torch.Tensor, header: bool) -> None:
        n = t.numel() * t.element_size()
        if header:
            self.stats.header_msgs += 1
            self.stats.header_bytes += n
        else:
            self.stats.payload_msgs += 1
            self.stats.payload_bytes += n

    def send(self, t: torch.Tensor, peer: int, what: object, header: bool = False):
        """Start sending contiguous `t` to global rank `peer`; `t` is kept alive until the send completes.
        Returns the send's work: `t` may be written again once `sent(work, generation)` says so."""
        self._count(t, header)
        group, rank = self._peer(peer)
        try:
            work = group.send([t], rank, 0)
        except RuntimeError as e:
            raise self._error(what, peer, "send", e) from e
        # sends to a peer complete in order: drop the oldest while done (gloo's are only done once waited for)
        while self.pending and self.pending[0][0].is_completed():
            self.pending.pop(0)
        self.pending.append((work, t, what, peer))
        return work

    def sent(self, work, generation: int) -> bool:
        """Whether the send `work`, started when `batches_done` was `generation`, has completed."""
        return generation < self.batches_done or work.is_completed()

    def post_recv(self, t: torch.Tensor, peer: int, header: bool = False):
        """Start receiving into `t` from global rank `peer`; finish with `wait_recv`."""
        self._count(t, header)
        group, rank = self._peer(peer)
        return group.recv([t], rank, 0), t, peer

    def wait_recv(self, posted, what: object) -> torch.Tensor:
        """Wait at most `timeout_s` for a receive started by `post_recv`; returns its tensor."""
        work, t, peer = posted
        start = time.perf_counter()
        try:
            work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise self._error(what, peer, "receive", e) from e
        self.stats.recv_wait_s += time.perf_counter() - start
        return t

    def recv(self, t: torch.Tensor, peer: int, what: object, header: bool = False) -> torch.Tensor:
        """Receive into `t` from global rank `peer`, waiting at most `timeout_s`."""
        return self.wait_recv(self.post_recv(t, peer, header), what)

    def wait_sends(self) -> None:
        """Wait for every outstanding send (end of batch)."""
        pending, self.pending = self.pending, []
        for work, _, what, peer in pending:
            try:
                work.wait(timeout=datetime.timedelta(seconds=self.timeout_s))
            except RuntimeError as e:
                raise self._error(what, peer, "send", e) from e
        self.batches_done += 1

    def _error(self, what: object, peer: int, verb: str, e: Exception) -> PipelineCommError:
        return PipelineCommError(f"pipeline stage {self.stage_id}, instruction {what}: {verb} with rank {peer} "
                                 f"failed or timed out after {self.timeout_s:g}s (pipeline.timeout_s / "
                                 f"TDS_TIMEOUT_S): {e}")
