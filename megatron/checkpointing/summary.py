"""inspect: what a checkpoint holds.

It reads metadata only: megatron_args.json, manifest.json (every file's size is checked against it), the
pickled headers of the layer files (tensor shapes; the tensor data is memory-mapped and never read) and the
scalars of one engine file, so it takes about the same time on a multi-GB checkpoint as on a small one.
With --verify it also reads every file and compares its CRC-32 with the manifest's.
"""
from __future__ import annotations

import os
from typing import Dict, List, Optional, Tuple

import torch

from .consolidated import has_engine_state, has_optimizer, layout_of
from .files import folder_bytes, layer_file, mp_rank_file, read_args
from .reading import load_file
from .manifest import checked_folder, role, verify_checksums
from .names import ModelTable, virtual_stages
from .optim import optimizer_kind

OPTIMIZER_LAYOUTS = {"zero": "ZeRO-1 flat fp32 partitions per dp rank", "client": "torch AdamW in mp_rank files",
                     "unfused": "fp32 groups in mp_rank files", "bf16": "BF16_Optimizer flat fp32 (dp = 1)"}


def _precision(args: Dict) -> str:
    return "fp16" if args.get("fp16") else "bf16" if args.get("bf16") else "fp32"


def _file_roles(files: List[str], table: ModelTable, tp: int) -> List[Tuple[str, str]]:
    """(file name, what it holds): the layer files the table names, then the engine and optimizer files among
    `files` (the folder's listing, sorted)."""
    roles = []
    for layer in range(len(table.specs)):
        params = table.layer_params(layer)
        if params:
            prefix = os.path.commonprefix([p.name for p in params]).rstrip(".") or params[0].name
            for t in range(tp):
                roles.append((layer_file(layer, t), f"pipeline layer {layer}, tp rank {t}: {prefix}*"))
    return roles + [(name, role(name, tp)) for name in files
                    if name.startswith("mp_rank_") or "zero_pp_rank_" in name]


def full_shapes(folder: str, table: ModelTable, tp: int) -> Dict[str, torch.Size]:
    """Every parameter's full (tp = 1) shape from the layer files' headers (data memory-mapped, not read)."""
    shapes = {}
    for layer in range(len(table.specs)):
        params = table.layer_params(layer)
        if not params:
            continue
        local = load_file(os.path.join(folder, layer_file(layer, 0)), mmap=True, verify=False)
        for p in params:
            shape = list(local[p.local].shape)
            if p.dim is not None:
                shape[p.dim] *= tp
            shapes[p.name] = torch.Size(shape)
    return shapes


def inspect_lines(load_dir: str, tag: Optional[str] = None, verify: bool = False) -> List[str]:
    """The report `tools/convert_checkpoint.py inspect` prints; the files' sizes are checked first (`verify`:
    their checksums too, `manifest.verify_checksums`)."""
    folder = checked_folder(load_dir, tag)
    args = read_args(folder)
    table = ModelTable(args)
    tp, pp, dp = layout_of(args)
    engine = load_file(os.path.join(folder, mp_rank_file(0)), mmap=True, verify=False) if has_engine_state(args) else {}
    shapes = full_shapes(folder, table, tp)
    files = sorted(os.listdir(folder))
    kind = optimizer_kind(args) if has_optimizer(args) else None
    lines = [f"checkpoint       {folder} ({folder_bytes(folder, files) / 1e6:.1f} MB in {len(files)} files)",
             f"model            {args['model_type']}: {args['num_layers']} layers, hidden {args['hidden_size']}, "
             f"{args['num_attention_heads']} heads, ffn {args['ffn_hidden_size']}, vocabulary {args['vocab_size']} "
             f"(padded {args['padded_vocab_size']})",
             f"iteration        {engine.get('iteration', 0)}",
             f"consumed samples {engine.get('consumed_train_samples', 0)}",
             f"(tp, pp, dp)     ({tp}, {pp}, {dp})" + (f", {virtual_stages(args)} model chunks per pipeline stage "
                                                     f"(interleaved)" if virtual_stages(args) > 1 else ""),
             f"ZeRO stage       {args.get('zero_stage')} (DeepSpeed ran stage "
             f"{args['ds_config']['zero_optimization']['stage']})",
             f"precision        {_precision(args)}",
             f"optimizer        {OPTIMIZER_LAYOUTS[kind] if kind else 'none (weights only)'}",
             f"parameters       {sum(s.numel() for s in shapes.values()):,}", "", "parameter shapes (full, tp = 1):"]
    lines += [f"  {name:60s} {tuple(shape)}" for name, shape in shapes.items()]
    lines += ["", "files:"] + [f"  {name:50s} {what}" for name, what in _file_roles(files, table, tp)]
    return lines + ([verify_checksums(folder, args)] if verify else [])
