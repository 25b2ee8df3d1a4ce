"""Broadcast a batch from tensor-parallel rank 0 to the other ranks of its tensor-parallel group (Megatron).

Only tp rank 0 reads data; the others receive it in two broadcasts:
    1. sizes: an int64 tensor (len(keys), MAX_DIMS), row k = shape of data[keys[k]] padded with zeros;
    2. values: every data[keys[k]] flattened and concatenated, as one `datatype` tensor.
"""
from __future__ import annotations

from typing import Dict, Sequence

import torch
import torch.distributed as dist

from tds.device import device
from .mappings import resolve_group

MAX_DIMS = 8


def _sizes_tensor(keys: Sequence[str], data: Dict[str, torch.Tensor]) -> torch.Tensor:
    sizes = torch.zeros(len(keys), MAX_DIMS, dtype=torch.long)
    for k, key in enumerate(keys):
        shape = data[key].shape
        if len(shape) > MAX_DIMS:
            raise ValueError(f"broadcast_data: {key!r} has {len(shape)} dims, at most {MAX_DIMS} supported")
        sizes[k, :len(shape)] = torch.tensor(shape, dtype=torch.long)
    return sizes


def _check_dtypes(keys: Sequence[str], data: Dict[str, torch.Tensor], datatype: torch.dtype) -> None:
    for key in keys:
        if data[key].dtype != datatype:
            raise ValueError(f"broadcast_data: {key!r} has dtype {data[key].dtype}, expected {datatype}")


def broadcast_data(keys: Sequence[str], data: Dict[str, torch.Tensor], datatype: torch.dtype,
                   tp_group=None) -> Dict[str, torch.Tensor]:
    """{key: tensor on the device} on every rank, equal to tp rank 0's `data` (ignored on other ranks).

    Shapes may be anything up to 8 dims (a size-0 dim ends the shape, as in Megatron).
    """
    group, tp_rank, tp_size = resolve_group(tp_group)
    if tp_rank == 0:
        _check_dtypes(keys, data, datatype)
        sizes = _sizes_tensor(keys, data)
    else:
        sizes = torch.empty(len(keys), MAX_DIMS, dtype=torch.long)
    src = dist.get_global_rank(group, 0) if tp_size > 1 else 0
    sizes = sizes.to(device())
    if tp_size > 1:
        dist.broadcast(sizes, src, group=group)
    shapes = [[int(d) for d in row if d > 0] for row in sizes.cpu()]
    numels = [int(torch.Size(s).numel()) for s in shapes]
    if tp_rank == 0:
        flat = torch.cat([data[key].contiguous().view(-1) for key in keys]).to(device())
    else:
        flat = torch.empty(sum(numels), dtype=datatype, device=device())
    if tp_size > 1:
        dist.broadcast(flat, src, group=group)
    out, offset = {}, 0
    for key, shape, numel in zip(keys, shapes, numels):
        out[key] = flat.narrow(0, offset, numel).view(shape)
        offset += numel
    return out
