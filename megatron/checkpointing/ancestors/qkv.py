"""Megatron-LM's fused QKV rows <-> this project's [Q; K; V] block layout (rows Q: heads x hn, K and V: groups x hn,
heads in order; `megatron/mpu/utils.py` cuts it over tp by block stride (heads, groups, groups)).

Shape legend (one tp rank's rows): np heads on the rank, ng query groups on it, hn head width; a weight has h
columns after the rows, a bias none.

    order  written by                                        rows of one tp rank
    '0'    checkpoint_version 0 (or none recorded)           [3, np, hn]: all q, then all k, then all v
    '1'    checkpoint_version 1.0                            [np, hn, 3]
    '2'    checkpoint_version 2.0 / 3.0, Megatron core       [ng, np/ng + 2, hn]: per query group its q heads, k, v
           (ng = np without grouped-query attention: [np, 3, hn], per head q, k, v)

Each rank's rows are cut into q, k, v first and the ranks then joined block by block (Q = [q_0; q_1; ...]), as
DeepSpeed's MegatronSDLoader merges version 0; exact for every order. Megatron core's torch_dist stores the
global tensor: the tp ranks' order-'2' rows one after the other, i.e. one "rank" holding every group.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

import torch

from megatron.errors import UserError

ORDERS = ("0", "1", "2")
VERSION_ORDER = {0: "0", 1: "1", 2: "2", 3: "2"}  # checkpoint_version (floor) -> row order


def order_of_version(version) -> str:
    """The row order a Megatron-LM checkpoint_version implies (None, absent: version 0)."""
    v = int(float(version or 0))
    if v not in VERSION_ORDER:
        raise UserError(f"checkpoint_version {version} is not one Megatron-LM wrote (0, 1.0, 2.0, 3.0)")
    return VERSION_ORDER[v]


def split_rank(rows: torch.Tensor, order: str, heads: int, groups: int, hn: int
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One tp rank's fused rows ((np + 2 ng) hn [, h]) -> its q (np hn), k and v (ng hn) rows."""
    rest = tuple(rows.shape[1:])
    if rows.size(0) != (heads + 2 * groups) * hn:
        raise UserError(f"QKV rows {rows.size(0)} != (heads {heads} + 2 x groups {groups}) x head width {hn}: the "
                        f"checkpoint's attention does not match its arguments")
    if order in ("0", "1") and groups != heads:
        raise UserError(f"QKV order {order} predates grouped-query attention; a checkpoint with {groups} query groups "
                        f"for {heads} heads is in order 2")
    if order == "0":
        x = rows.reshape(3, heads, hn, *rest)
        q, k, v = x[0], x[1], x[2]
    elif order == "1":
        x = rows.reshape(heads, hn, 3, *rest)
        q, k, v = x[:, :, 0], x[:, :, 1], x[:, :, 2]
    elif order == "2":
        per = heads // groups
        x = rows.reshape(groups, per + 2, hn, *rest)
        q, k, v = x[:, :per], x[:, per], x[:, per + 1]
    else:
        raise UserError(f"--qkv-order {order!r}: one of {', '.join(ORDERS)}")
    return (q.reshape(heads * hn, *rest), k.reshape(groups * hn, *rest), v.reshape(groups * hn, *rest))


def merge_qkv(parts: Sequence[torch.Tensor], order: str, heads: int, groups: int, hn: int) -> torch.Tensor:
    """Per-tp-rank fused rows (every rank in `order`; heads and groups of the whole model) -> [Q; K; V]."""
    tp = len(parts)
    if heads % tp or groups % tp:
        raise UserError(f"{tp} tensor-parallel parts do not divide {heads} heads and {groups} query groups")
    qkv = [split_rank(p, order, heads // tp, groups // tp, hn) for p in parts]
    return torch.cat([torch.cat([r[i] for r in qkv]) for i in range(3)]).contiguous()


def split_qkv(full: torch.Tensor, tp: int, heads: int, groups: int, hn: int) -> List[torch.Tensor]:
    """[Q; K; V] -> each tp rank's rows in order '2' (what Megatron-LM writes since checkpoint_version 2.0)."""
    rest = tuple(full.shape[1:])
    q, k, v = full.split([heads * hn, groups * hn, groups * hn])
    per, g = heads // groups, groups // tp
    q = q.reshape(groups, per, hn, *rest)
    k, v = k.reshape(groups, 1, hn, *rest), v.reshape(groups, 1, hn, *rest)
    grouped = torch.cat([q, k, v], dim=1)  # (groups, per + 2, hn, ...)
    return [grouped[r * g:(r + 1) * g].reshape(-1, *rest).contiguous() for r in range(tp)]
