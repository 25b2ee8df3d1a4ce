"""export-hf / import-hf: this project's checkpoints <-> Hugging Face transformers folders, through the adapter
table (`megatron.checkpointing.hf.ADAPTERS`: config.json and tensor names per architecture).

    export_hf(ckpt, out)    full weights (any tp, pp) -> vocabulary padding removed -> HF names (the adapter's
                            rules) -> out/model.safetensors, config.json, generation_config.json, tokenizer files
                            (none when the checkpoint records no tokenizer)
    import_hf(hf_dir, ckpt, tp, pp)   the reverse, padded for tp, written as a weights-only checkpoint at
                            (tp, pp, 1): `--load` starts from it at iteration 0 with a fresh optimizer; its
                            arguments record the architecture (`hf_architecture`), which export writes again

Vocabulary rows. An HF table may have more rows than its tokenizer has ids (t5-small: 32128 rows = 32000
pieces + 100 sentinels + 28 padding rows). Import keeps all of them: vocab_size = the tokenizer's ids (what
training's tokenizer gives, so `--load` accepts the checkpoint), hf_vocab_size = config.json's vocab_size,
padded_vocab_size >= hf_vocab_size, so the HF padding rows sit in Megatron's padding (masked out of the
logits like any padding row). Export writes hf_vocab_size rows (vocab_size for a checkpoint trained here).

Outputs are written under a temporary name and renamed when complete. No network: the input is a folder.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from megatron.errors import UserError
from ..consolidated import Consolidated, layout_of, read_weights
from ..files import (CheckpointFileError, atomic_folder, folder_bytes, new_checkpoint, read_args, read_json,
                     write_json)
from ..layouts import check_layout, layout_args, table_rows, write_layout
from ..manifest import WEIGHTS, checked_folder
from ..names import ModelTable
from ..reading import load_file as load_checkpoint_file
from ..space import tensor_bytes
from ..tp import resize_rows
from . import adapter_for, exporter
from .base import Adapter, refuse
from .tokenizer_files import import_tokenizer, sentinel_order, write_tokenizer

IMPORT_TAG = "iter_0000000"
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")  # generation_config.json's


@dataclass
class ExportReport:
    model_type: str
    files: List[str]
    parameters: int
    note: str = ""


def to_hf(weights: Dict[str, torch.Tensor], args: Dict, table: ModelTable,
          adapter: Adapter) -> Dict[str, torch.Tensor]:
    """Canonical full weights -> HF state dict (vocabulary rows [0, table_rows) only, sentinels in HF order)."""
    rows = table_rows(args)
    order = sentinel_order(args, rows)
    out = {}
    for rule in adapter.rules(table.config):
        full = weights[rule.canonical]
        if table.by_name[rule.canonical].vocab:
            full = resize_rows(full, rows)
            full = full if order is None else full[order]
        for name, piece in zip(rule.hf, rule.split(full)):
            out[name] = (piece.t() if rule.transpose else piece).contiguous().clone()
    return out


def from_hf(hf: Dict[str, torch.Tensor], args: Dict, table: ModelTable, adapter: Adapter,
            where: str) -> Dict[str, torch.Tensor]:
    """HF state dict -> canonical full weights: every row of the HF table (sentinels in this project's order),
    padded to args['padded_vocab_size'] with zeros; UserError naming config.json where a tensor's shape is not
    the one the config's model has (a shape field missing from config.json falls back to its default)."""
    rows = table_rows(args)
    order = sentinel_order(args, rows)
    shapes = table.full_shapes()
    weights = {}
    for rule in adapter.rules(table.config):
        names = rule.tied if rule.tied and rule.hf[0] not in hf else rule.hf
        missing = [n for n in names if n not in hf]
        if missing:
            raise UserError(f"{where}: no tensor {missing[0]} in its weights ({weight_files(where)}; the HF weights do "
                            f"not match their config.json)")
        full = torch.cat([hf[n].t() if rule.transpose else hf[n] for n in names], dim=0)
        if rule.stack:  # per-expert (rows, cols) tensors, or the fused (E, rows, cols) one
            full = full.reshape(rule.stack, -1, full.shape[-1])
        if table.by_name[rule.canonical].vocab:
            if full.size(0) != rows:
                raise UserError(f"{where}: {names[0]} has {full.size(0)} rows in {weight_files(where)} but config.json "
                                f"has vocab_size {rows} (the HF weights do not match their config.json)")
            full = resize_rows(full if order is None else full[order], args["padded_vocab_size"])
        vocab = int(table.by_name[rule.canonical].vocab)  # its rows were checked above
        if tuple(full.shape)[vocab:] != shapes[rule.canonical][vocab:]:
            raise UserError(f"{os.path.join(where, 'config.json')} does not match the weights: {names[0]} has shape "
                            f"{tuple(hf[names[0]].shape)} in {weight_files(where)}, where the config's model has "
                            f"{rule.canonical} {shapes[rule.canonical]} (a shape field such as the hidden size, the "
                            f"positions or the heads is missing or changed)")
        weights[rule.canonical] = full.contiguous()
    return weights


def _tokenizer(args: Dict, overrides: Dict[str, Optional[str]]):
    """The checkpoint's tokenizer (files replaced by `overrides`), or None when it records none."""
    from megatron.tokenizer import build_tokenizer
    if not args.get("tokenizer_type"):
        given = [f"--{k.replace('_', '-')}" for k, v in overrides.items() if v]
        if given:
            raise UserError(f"export-hf: {' '.join(given)} replaces a file of the checkpoint's tokenizer, but the "
                            f"checkpoint records none (imported from a folder without tokenizer files); export "
                            f"without it and copy the tokenizer files into the output folder")
        return None
    spec = {k: overrides.get(k) or args.get(k) for k in ("tokenizer_type", "vocab_file", "merge_file",
                                                          "tokenizer_model")}
    needed = ["vocab_file", "merge_file"] if spec["tokenizer_type"] == "GPT2BPETokenizer" else ["tokenizer_model"]
    for key in needed:
        if not spec[key] or not os.path.exists(spec[key]):
            raise UserError(f"export-hf: the checkpoint's {key} {spec[key]!r} (its megatron_args.json) does not "
                            f"exist here; pass --{key.replace('_', '-')} PATH")
    args.update(spec)
    return build_tokenizer(spec["tokenizer_type"], spec["vocab_file"], spec["merge_file"], spec["tokenizer_model"],
                           args.get("vocab_extra_ids", 0) or 0)


def _export_bytes(tensors: Dict[str, torch.Tensor], args: Dict) -> int:
    """About the size of an export: the weights, the tokenizer's files (copied or rewritten) and a few kB of
    configuration."""
    sources = [args.get(k) for k in ("vocab_file", "merge_file", "tokenizer_model") if args.get(k)]
    tokenizer = sum(os.path.getsize(p) if os.path.isfile(p) else folder_bytes(p) if os.path.isdir(p) else 0
                    for p in sources)
    return tensor_bytes(tensors) + 2 * tokenizer + (64 << 10)


def export_hf(load_dir: str, output: str, tag: Optional[str] = None,
              tokenizer_overrides: Optional[Dict[str, Optional[str]]] = None) -> ExportReport:
    """Write the checkpoint as a transformers folder `output`, in the architecture `exporter` picks (one line naming
    each field of the model that architecture's config.json cannot hold)."""
    from safetensors.torch import save_file
    folder = checked_folder(load_dir, tag, (WEIGHTS,))
    args = dict(read_args(folder))
    table = ModelTable(args)
    adapter = exporter(args, table.config)
    refuse(adapter.cannot_hold(table.config), f"export-hf: {adapter.architecture} cannot hold this checkpoint's model")
    tokenizer = _tokenizer(args, tokenizer_overrides or {})
    ids = adapter.token_ids(tokenizer) if tokenizer else dict(args.get("hf_token_ids") or {})
    config = adapter.hf_config(table.config, table_rows(args), ids)
    tensors = to_hf(read_weights(folder, table, layout_of(args)[0]), args, table, adapter)
    config["dtype"] = str(next(iter(tensors.values())).dtype).replace("torch.", "")
    with atomic_folder(output, _export_bytes(tensors, args)) as tmp:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        write_json(os.path.join(tmp, "config.json"), config)
        write_json(os.path.join(tmp, "generation_config.json"), {k: config[k] for k in TOKEN_IDS if k in config})
        files = ["model.safetensors", "config.json", "generation_config.json"]
        files += write_tokenizer(tmp, args, tokenizer, adapter.model_max_length(table.config)) if tokenizer else []
    note = "" if tokenizer else (f"no tokenizer files written: the checkpoint records no tokenizer (imported from "
                                 f"a folder without one); copy the model's tokenizer files into {output}")
    return ExportReport(args["model_type"], files, sum(t.numel() for t in tensors.values()), note)


def weight_files(hf_dir: str) -> str:
    """The weight files of a transformers folder, for messages."""
    names = sorted(n for n in os.listdir(hf_dir) if n.endswith((".safetensors", ".bin"))) if os.path.isdir(hf_dir) else []
    return ", ".join(names) or "no weight file"


def _safetensors(path: str) -> Dict[str, torch.Tensor]:
    """safetensors' load_file; a file it cannot read (a damaged header, cut short) is one line naming it."""
    from safetensors.torch import load_file
    try:
        return load_file(path)
    except Exception as err:  # noqa: BLE001 (SafetensorError, OSError, ...: the file cannot be read)
        raise CheckpointFileError(f"{path} cannot be read as safetensors ({type(err).__name__}: "
                                  f"{str(err).splitlines()[0][:160]}); the file is damaged or cut short") from None


def load_hf_state(hf_dir: str) -> Dict[str, torch.Tensor]:
    """model.safetensors (one file or shards with an index) or pytorch_model.bin of a transformers folder."""
    single, index = os.path.join(hf_dir, "model.safetensors"), os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        return _safetensors(single)
    if os.path.isfile(index):
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointFileError(f"{index} has no 'weight_map' object")
        shards = sorted(set(map(str, weight_map.values())))
        return {k: v for shard in shards for k, v in _safetensors(os.path.join(hf_dir, shard)).items()}
    if os.path.isfile(os.path.join(hf_dir, "pytorch_model.bin")):
        return load_checkpoint_file(os.path.join(hf_dir, "pytorch_model.bin"), mmap=False)  # weights_only, allowlist
    raise CheckpointFileError(f"{hf_dir} has no model.safetensors, model.safetensors.index.json or "
                              f"pytorch_model.bin")


def import_hf(hf_dir: str, save_dir: str, tp: int, pp: int) -> Dict:
    """A transformers folder of an architecture in the adapter table -> a weights-only checkpoint directory at
    (tp, pp, 1); returns its args."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointFileError(f"{config_path} is missing: --input must be a transformers model folder")
    cfg = read_json(config_path)
    adapter = adapter_for(cfg, config_path)
    args = dict(adapter.project_args(cfg, config_path), hf_architecture=adapter.architecture)
    state = load_hf_state(hf_dir)
    with new_checkpoint(save_dir, IMPORT_TAG, tensor_bytes(state)) as folder:
        tmp = os.path.dirname(folder)
        tok_args, tokenizer = import_tokenizer(hf_dir, folder)  # files copied into the temporary folder
        args.update(_final_paths(tok_args, tmp, save_dir), **_vocabulary(cfg, tok_args, tokenizer, config_path))
        args.update(layout_args(args, tp, pp))
        table = ModelTable(args)
        check_layout(table, args, tp, pp)
        weights = from_hf(state, args, table, adapter, hf_dir)
        del state
        write_layout(Consolidated(args=args, weights=weights), folder, args, with_optimizer=False)
    return read_args(os.path.join(save_dir, IMPORT_TAG))


def _vocabulary(cfg: Dict, tok_args: Dict, tokenizer, where: str) -> Dict:
    """vocab_size (the tokenizer's ids, else every row), hf_vocab_size (the HF table's rows) and the config's
    special token ids (exported again when there is no tokenizer to take them from)."""
    rows = cfg.get("vocab_size")
    if not isinstance(rows, int) or rows < 1:
        raise UserError(f"{where} has vocab_size {rows!r}; a transformers config.json names its table's rows")
    vocab = tokenizer.vocab_size if tokenizer else rows
    if vocab > rows:
        extra = tok_args.get("vocab_extra_ids", 0)
        raise UserError(f"{where}: vocab_size {rows} is smaller than the tokenizer's {vocab} ids ({vocab - extra} "
                        f"base ids + {extra} sentinels <extra_id_*>); give the folder the tokenizer its weights "
                        f"were trained with (T5: tokenizer_config.json \"extra_ids\")")
    return dict(vocab_size=vocab, hf_vocab_size=rows,
                hf_token_ids={k: cfg[k] for k in TOKEN_IDS if isinstance(cfg.get(k), int)})


def _final_paths(tok_args: Dict, tmp: str, final: str) -> Dict:
    """The tokenizer paths inside the temporary folder -> the same files in the final one, so the
    megatron_args.json written before the rename already names where they will be after it."""
    return {k: (v.replace(os.path.abspath(tmp), os.path.abspath(final)) if isinstance(v, str) else v)
            for k, v in tok_args.items()}
