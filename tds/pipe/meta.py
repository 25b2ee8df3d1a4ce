"""The layout of the tuple that crosses a stage boundary, and its wire format.

The model may declare, per tuple position i, three lists (then the single source of truth for both directions):

    model._input_grad             = [True, False]        # does position i carry a gradient back?
    model._input_type             = ['float', 'bool']    # dtype family of position i
    model._input_pipe_partitioned = [True, False]        # split position i across the tensor-parallel group?

Undeclared, each sending stage infers its boundary's layout from the tuple it sends on its first training
micro-batch (`infer_declarations`: requires_grad -> grad, the dtype's family -> type, never partitioned) and
the header tells the receiver (the grad bit below).

Wire pieces (how a hop uses them, sending the header only when the layout changes: `boundary.py`):

    header  int64[2 + n*(2 + MAX_NDIM)] = [flags, n, (code, ndim, *shape, 0-padding) * n]
            flags = is_tuple | GRADS_KNOWN (the grad bits are meaningful: a training hop)
            code  = dtype_id | GRAD_BIT (position carries a gradient back)
    payload uint8[...] = concatenation of each tensor's bytes (or its 1/tp chunk when partitioned),
                         each segment padded to ALIGN bytes so the receiver views it without copying

A gradient hop carries no header: the receiver knows the shapes and dtypes of the outputs it sent; only
positions with grad travel, a missing (None) gradient travels as zeros.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

MAX_NDIM = 8
MAX_INFERRED = 64  # positions of an undeclared tuple: sizes the first header before the receiver knows n
ALIGN = 16
GRADS_KNOWN, GRAD_BIT = 2, 1 << 8  # header flag / per-position code bits (dtype ids are < 256)
ID_TO_DTYPE = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
               torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128]
DTYPE_TO_ID = {dt: i for i, dt in enumerate(ID_TO_DTYPE)}
_FAMILIES = {
    "float": {torch.float32, torch.float64, torch.float16, torch.bfloat16},
    "int": {torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64},
    "float32": {torch.float32}, "float16": {torch.float16}, "half": {torch.float16},
    "bfloat16": {torch.bfloat16}, "bf16": {torch.bfloat16}, "float64": {torch.float64},
    "int32": {torch.int32}, "int64": {torch.int64}, "long": {torch.int64}, "bool": {torch.bool},
}


class PipelineLayoutError(ValueError):
    """A tuple crossing a stage boundary does not match the model's declaration."""


@dataclass(frozen=True)
class TensorDecl:
    """Declaration of one tuple position."""
    grad: bool
    type: str
    partitioned: bool

    def accepts(self, dtype: torch.dtype) -> bool:
        return dtype in _FAMILIES[self.type]


def make_declarations(input_grad: Sequence[bool], input_type: Sequence[str],
                      input_pipe_partitioned: Sequence[bool] | None) -> list[TensorDecl]:
    """Validate the three lists and zip them; `input_pipe_partitioned=None` means no position is partitioned."""
    parts = [False] * len(input_type) if input_pipe_partitioned is None else list(input_pipe_partitioned)
    if not len(input_grad) == len(input_type) == len(parts):
        raise PipelineLayoutError(f"_input_grad ({len(input_grad)}), _input_type ({len(input_type)}) and "
                                  f"_input_pipe_partitioned ({len(parts)}) must have one entry per tuple position")
    decls = []
    for pos, (grad, typ, part) in enumerate(zip(input_grad, input_type, parts)):
        if typ not in _FAMILIES:
            raise PipelineLayoutError(f"_input_type[{pos}]={typ!r} is not one of {sorted(_FAMILIES)}")
        if grad and not any(dt.is_floating_point for dt in _FAMILIES[typ]):
            raise PipelineLayoutError(f"_input_grad[{pos}]=True but _input_type[{pos}]={typ!r} cannot carry a "
                                      f"gradient; declare it 'float' or set _input_grad[{pos}]=False")
        decls.append(TensorDecl(bool(grad), typ, bool(part)))
    return decls


def family(dtype: torch.dtype) -> str | None:
    """'float' | 'int' | 'bool' for a dtype that can cross a boundary, else None."""
    for name in ("float", "int", "bool"):
        if dtype in _FAMILIES[name]:
            return name
    return None


def infer_declarations(tensors: tuple) -> list[TensorDecl]:
    """The layout a sender's tuple implies: grad where the tensor requires grad, its dtype family, not partitioned.

    Raises PipelineLayoutError naming the position when a tensor cannot travel undeclared."""
    if len(tensors) > MAX_INFERRED:
        raise PipelineLayoutError(f"an undeclared stage output has {len(tensors)} tensors (at most {MAX_INFERRED} "
                                  f"are inferred); declare model._input_grad / model._input_type")
    decls = []
    for pos, t in enumerate(tensors):
        if not torch.is_tensor(t):
            raise PipelineLayoutError(f"position {pos}: a stage must send tensors, got {type(t).__name__}")
        fam = family(t.dtype)  # every dtype of a family has a wire id (DTYPE_TO_ID)
        if fam is None:
            raise PipelineLayoutError(f"position {pos}: dtype {t.dtype} cannot be sent (known: {ID_TO_DTYPE[:10]})")
        check_ndim(pos, t)
        decls.append(TensorDecl(bool(t.requires_grad), fam, False))
    return decls


def describe(decls: Sequence[TensorDecl]) -> str:
    """The three model attributes that declare `decls`, as code a user can paste."""
    return (f"model._input_grad = {[d.grad for d in decls]}; model._input_type = {[d.type for d in decls]}; "
            f"model._input_pipe_partitioned = {[d.partitioned for d in decls]}")


def as_tuple(value) -> tuple[tuple, bool]:
    """(tensors, was_tuple): a bare tensor travels as a 1-tuple and is unwrapped on arrival."""
    if torch.is_tensor(value):
        return (value,), False
    if isinstance(value, (tuple, list)):
        return tuple(value), True
    raise PipelineLayoutError(f"a stage must return a tensor or a tuple of tensors, got {type(value).__name__}")


def check_layout(tensors: tuple, decls: list[TensorDecl]) -> None:
    """Raise PipelineLayoutError naming the first position whose tensor does not match its declaration."""
    if len(tensors) != len(decls):
        raise PipelineLayoutError(f"stage output has {len(tensors)} tensors but the model declares {len(decls)} "
                                  f"(_input_type={[d.type for d in decls]})")
    for pos, (t, d) in enumerate(zip(tensors, decls)):
        if not torch.is_tensor(t):
            raise PipelineLayoutError(f"position {pos}: declared {d.type!r} tensor, got {type(t).__name__}")
        if not d.accepts(t.dtype):
            raise PipelineLayoutError(f"position {pos}: declared type {d.type!r} (grad={d.grad}, partitioned="
                                      f"{d.partitioned}) but got dtype {t.dtype} shape {tuple(t.shape)}")
        check_ndim(pos, t)
        if t.dtype not in DTYPE_TO_ID:
            raise PipelineLayoutError(f"position {pos}: dtype {t.dtype} cannot be sent (known: {ID_TO_DTYPE})")


def check_ndim(pos: int, t: torch.Tensor) -> None:
    """Raise PipelineLayoutError when tensor `t` at position `pos` has more dims than a header holds."""
    if t.dim() > MAX_NDIM:
        raise PipelineLayoutError(f"position {pos}: {t.dim()} dims exceed MAX_NDIM={MAX_NDIM} "
                                  f"(shape {tuple(t.shape)})")


def header_len(n: int) -> int:
    return 2 + n * (2 + MAX_NDIM)


def encode_header(tensors: tuple, was_tuple: bool, grads: Sequence[bool] | None = None) -> torch.Tensor:
    """The header of `tensors`; `grads` (one flag per position) is given on training hops, None otherwise."""
    h = torch.zeros(header_len(len(tensors)), dtype=torch.int64)
    h[0], h[1] = int(was_tuple) | (GRADS_KNOWN if grads is not None else 0), len(tensors)
    for i, t in enumerate(tensors):
        o = 2 + i * (2 + MAX_NDIM)
        h[o] = DTYPE_TO_ID[t.dtype] | (GRAD_BIT if grads is not None and grads[i] else 0)
        h[o + 1] = t.dim()
        h[o + 2:o + 2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    return h


def decode_header(h: torch.Tensor) -> tuple[list[tuple[torch.dtype, tuple]], bool, tuple[bool, ...] | None]:
    """[(dtype, shape)] per position, whether the sender sent a tuple, and the grad flags (None if not sent)."""
    vals = h.tolist()
    specs, grads = [], []
    for i in range(vals[1]):
        o = 2 + i * (2 + MAX_NDIM)
        specs.append((ID_TO_DTYPE[vals[o] & (GRAD_BIT - 1)], tuple(vals[o + 2:o + 2 + vals[o + 1]])))
        grads.append(bool(vals[o] & GRAD_BIT))
    return specs, bool(vals[0] & 1), (tuple(grads) if vals[0] & GRADS_KNOWN else None)


def chunk_numel(numel: int, tp_size: int) -> int:
    """Elements per tensor-parallel rank when a tensor of `numel` elements is split (zero-padded) tp ways."""
    return math.ceil(numel / tp_size) if numel else 0


def split_for_rank(t: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """This rank's 1/tp chunk of flatten(t), zero-padded at the end: (ceil(numel/tp),)."""
    c = chunk_numel(t.numel(), tp_size)
    flat = t.reshape(-1)
    part = flat[tp_rank * c:(tp_rank + 1) * c]
    if part.numel() < c:
        part = torch.cat([part, part.new_zeros(c - part.numel())])
    return part


def _segment_bytes(numel: int, dtype: torch.dtype) -> int:
    return (numel * dtype.itemsize + ALIGN - 1) // ALIGN * ALIGN


def pack(parts: list[torch.Tensor], prefix: int = 0, total: int | None = None) -> torch.Tensor:
    """Concatenate flat tensors of any dtypes into one uint8 buffer, each segment ALIGN-padded, after
    `prefix` bytes left for the caller; the buffer is zero-padded to `total` bytes when that is larger."""
    size = prefix + sum(_segment_bytes(p.numel(), p.dtype) for p in parts)
    buf = torch.empty(max(size, total or 0), dtype=torch.uint8, device=parts[0].device if parts else "cpu")
    if buf.numel() > size:
        buf[size:].zero_()
    off = prefix
    for p in parts:
        nbytes = p.numel() * p.dtype.itemsize
        buf[off:off + nbytes].view(p.dtype).copy_(p.detach().reshape(-1))  # (padding between segments: not read)
        off += _segment_bytes(p.numel(), p.dtype)
    return buf


def packed_size(specs: list[tuple[torch.dtype, int]]) -> int:
    """Bytes of `pack` for flat parts given as (dtype, numel)."""
    return sum(_segment_bytes(n, dt) for dt, n in specs)


def unpack(buf: torch.Tensor, specs: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """Inverse of `pack`: flat views of `buf`, one per (dtype, numel)."""
    out, off = [], 0
    for dt, n in specs:
        out.append(buf[off:off + n * dt.itemsize].view(dt))
        off += _segment_bytes(n, dt)
    return out
