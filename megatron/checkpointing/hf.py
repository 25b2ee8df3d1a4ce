"""export-hf / import-hf: this project's GPT-2 / T5 checkpoints <-> Hugging Face transformers folders.

    export_hf(ckpt, out)    full weights (any tp, pp) -> vocabulary padding removed -> HF names (hf_names.py)
                            -> out/model.safetensors, config.json, generation_config.json, tokenizer files
    import_hf(hf_dir, ckpt, tp, pp)   the reverse, padded for tp, written as a weights-only checkpoint at
                            (tp, pp, 1): `--load` starts from it at iteration 0 with a fresh optimizer

Outputs are written under a temporary name and renamed when complete. No network: the input is a folder.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from megatron.errors import UserError
from .consolidated import Consolidated, layout_of, read_weights
from .files import CheckpointFileError, atomic_folder, checkpoint_folder, publish_latest, read_args
from .hf_config import (generation_config, gpt2_args, gpt2_hf_config, import_tokenizer, layout_args, read_json,
                        sentinel_order, t5_args, t5_hf_config, write_json, write_tokenizer)
from .hf_names import Rule, gpt2_rules, t5_rules
from .layouts import check_layout, write_layout
from .names import ModelTable

IMPORT_TAG = "iter_0000000"


@dataclass
class ExportReport:
    model_type: str
    files: List[str]
    parameters: int


def rules_for(args: Dict) -> List[Rule]:
    if args["model_type"] == "gpt":
        return gpt2_rules(args["num_layers"])
    return t5_rules(args["num_layers"], args.get("decoder_num_layers") or args["num_layers"],
                    args.get("feed_forward_proj", "relu") == "gated-gelu",
                    not args.get("untie_embeddings_and_output_weights", False))


def to_hf(weights: Dict[str, torch.Tensor], args: Dict, table: ModelTable) -> Dict[str, torch.Tensor]:
    """Canonical full weights -> HF state dict (vocabulary rows [0, V) only, sentinels in HF order)."""
    vocab = args["vocab_size"]
    order = sentinel_order(args, vocab)
    out = {}
    for rule in rules_for(args):
        full = weights[rule.canonical]
        if table.by_name[rule.canonical].vocab:
            full = full[:vocab] if order is None else full[order]
        for name, piece in zip(rule.hf, full.chunk(len(rule.hf), dim=0)):
            out[name] = (piece.t() if rule.transpose else piece).contiguous().clone()
    return out


def from_hf(hf: Dict[str, torch.Tensor], args: Dict, table: ModelTable, where: str) -> Dict[str, torch.Tensor]:
    """HF state dict -> canonical full weights, vocabulary padded to args['padded_vocab_size'] with zeros."""
    vocab, padded = args["vocab_size"], args["padded_vocab_size"]
    order = sentinel_order(args, vocab)
    weights = {}
    for rule in rules_for(args):
        names = rule.hf
        if rule.canonical == "lm_head.weight" and names[0] not in hf:
            names = ("shared.weight",)  # transformers >= 5 saves T5's head tied to the table
        missing = [n for n in names if n not in hf]
        if missing:
            raise UserError(f"{where}: no tensor {missing[0]} (the HF weights do not match their config.json)")
        full = torch.cat([hf[n].t() if rule.transpose else hf[n] for n in names], dim=0)
        if table.by_name[rule.canonical].vocab:
            if full.size(0) < vocab:
                raise UserError(f"{where}: {names[0]} has {full.size(0)} rows but the tokenizer has {vocab} ids")
            full = full[:vocab] if order is None else full[:vocab][order]
            full = torch.cat([full, full.new_zeros(padded - vocab, full.size(1))])
        weights[rule.canonical] = full.contiguous()
    return weights


def _tokenizer(args: Dict, overrides: Dict[str, Optional[str]]):
    from megatron.tokenizer import build_tokenizer
    spec = {k: overrides.get(k) or args.get(k) for k in ("tokenizer_type", "vocab_file", "merge_file",
                                                          "tokenizer_model")}
    needed = ["tokenizer_model"] if spec["tokenizer_type"] == "SentencePieceTokenizer" else ["vocab_file",
                                                                                            "merge_file"]
    for key in needed:
        if not spec[key] or not os.path.isfile(spec[key]):
            raise UserError(f"export-hf: the checkpoint's {key} {spec[key]!r} is not a file here; pass "
                            f"--{key.replace('_', '-')} FILE")
    args.update(spec)
    return build_tokenizer(spec["tokenizer_type"], spec["vocab_file"], spec["merge_file"], spec["tokenizer_model"],
                           args.get("vocab_extra_ids", 0) or 0)


def export_hf(load_dir: str, output: str, tag: Optional[str] = None,
              tokenizer_overrides: Optional[Dict[str, Optional[str]]] = None) -> ExportReport:
    """Write the checkpoint as a transformers folder `output` (GPT2LMHeadModel or T5ForConditionalGeneration)."""
    from safetensors.torch import save_file
    folder = checkpoint_folder(load_dir, tag)
    args = dict(read_args(folder))
    if args.get("model_type") not in ("gpt", "t5"):
        raise UserError(f"export-hf handles GPT-2 and T5 checkpoints; {folder} holds model_type "
                        f"{args.get('model_type')!r}")
    table = ModelTable(args)
    tokenizer = _tokenizer(args, tokenizer_overrides or {})
    if args["model_type"] == "gpt":
        config, max_len = gpt2_hf_config(args, tokenizer.eod), args["max_position_embeddings"]
    else:
        config, max_len = t5_hf_config(args, tokenizer.pad, tokenizer.eos), args["encoder_seq_length"]
    tensors = to_hf(read_weights(folder, table, layout_of(args)[0]), args, table)
    config["dtype"] = str(next(iter(tensors.values())).dtype).replace("torch.", "")
    with atomic_folder(output) as tmp:
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        write_json(os.path.join(tmp, "config.json"), config)
        write_json(os.path.join(tmp, "generation_config.json"), generation_config(config))
        files = ["model.safetensors", "config.json", "generation_config.json"]
        files += write_tokenizer(tmp, args, tokenizer, max_len)
    return ExportReport(args["model_type"], files, sum(t.numel() for t in tensors.values()))


def load_hf_state(hf_dir: str) -> Dict[str, torch.Tensor]:
    """model.safetensors (one file or shards with an index) or pytorch_model.bin of a transformers folder."""
    from safetensors.torch import load_file
    single, index = os.path.join(hf_dir, "model.safetensors"), os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        return load_file(single)
    if os.path.isfile(index):
        shards = sorted(set(read_json(index)["weight_map"].values()))
        return {k: v for shard in shards for k, v in load_file(os.path.join(hf_dir, shard)).items()}
    if os.path.isfile(os.path.join(hf_dir, "pytorch_model.bin")):
        return torch.load(os.path.join(hf_dir, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    raise CheckpointFileError(f"{hf_dir} has no model.safetensors, model.safetensors.index.json or "
                              f"pytorch_model.bin")


def import_hf(hf_dir: str, save_dir: str, tp: int, pp: int) -> Dict:
    """A transformers GPT-2 / T5 folder -> a weights-only checkpoint directory at (tp, pp, 1); returns its args."""
    config_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(config_path):
        raise CheckpointFileError(f"{config_path} is missing: --input must be a transformers model folder")
    cfg = read_json(config_path)
    kind = cfg.get("model_type")
    if kind not in ("gpt2", "t5"):
        raise UserError(f"import-hf handles model_type 'gpt2' and 't5'; {config_path} has {kind!r}")
    args = (gpt2_args if kind == "gpt2" else t5_args)(cfg, config_path)
    with atomic_folder(save_dir) as tmp:
        folder = os.path.join(tmp, IMPORT_TAG)
        os.makedirs(folder)
        tok_args, tokenizer = import_tokenizer(hf_dir, folder)  # files copied into the temporary folder
        args.update(_final_paths(tok_args, tmp, save_dir),
                    vocab_size=tokenizer.vocab_size if tokenizer else cfg["vocab_size"])
        args.update(layout_args(args, tp, pp))
        table = ModelTable(args)
        check_layout(table, args, tp, pp)
        weights = from_hf(load_hf_state(hf_dir), args, table, hf_dir)
        write_layout(Consolidated(args=args, weights=weights), folder, args, with_optimizer=False)
        publish_latest(tmp, IMPORT_TAG)
        args = read_args(folder)
    return args


def _final_paths(tok_args: Dict, tmp: str, final: str) -> Dict:
    """The tokenizer paths inside the temporary folder -> the same files in the final one, so the
    megatron_args.json written before the rename already names where they will be after it."""
    return {k: (v.replace(os.path.abspath(tmp), os.path.abspath(final)) if isinstance(v, str) else v)
            for k, v in tok_args.items()}
