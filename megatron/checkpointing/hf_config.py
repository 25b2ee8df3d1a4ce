"""Hugging Face config.json / generation_config.json / tokenizer files <-> this project's saved arguments.

Written and read as plain JSON, so export needs no `transformers` (only `safetensors`).

T5 sentinels: this project numbers `<extra_id_i>` = V + i after the V sentencepiece pieces (Megatron's
order); transformers' T5Tokenizer numbers them the other way round (`<extra_id_i>` = V + E - 1 - i). Export
with a sentencepiece tokenizer reorders those E rows of the word table (and untied head) so the exported
model and T5Tokenizer agree; import reorders them back (`sentinel_order`). A GPT-2 BPE tokenizer's extra ids
are exported as added tokens with this project's ids, no reordering.
"""
from __future__ import annotations

import json
import os
import shutil
from typing import Any, Dict, List, Optional, Tuple

from megatron.errors import UserError
from megatron.model.config import padded_vocab_size

GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
T5_FFN = ("relu", "gated-gelu")


def read_json(path: str) -> Dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def write_json(path: str, obj: Dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")


# --- export: our arguments -> HF config ------------------------------------------------------------------
def gpt2_hf_config(args: Dict[str, Any], eod: int) -> Dict[str, Any]:
    h, heads = args["hidden_size"], args["num_attention_heads"]
    if args["kv_channels"] * heads != h:
        raise UserError(f"export-hf: kv_channels {args['kv_channels']} x heads {heads} != hidden_size {h}; "
                        f"GPT2LMHeadModel needs head width = hidden / heads")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": args["vocab_size"],
            "n_positions": args["max_position_embeddings"], "n_embd": h, "n_layer": args["num_layers"],
            "n_head": heads, "n_inner": args["ffn_hidden_size"], "activation_function": "gelu_new",
            "resid_pdrop": args["hidden_dropout"], "embd_pdrop": args["hidden_dropout"],
            "attn_pdrop": args["attention_dropout"], "layer_norm_epsilon": args["layernorm_epsilon"],
            "initializer_range": args.get("init_method_std", 0.02), "scale_attn_weights": True,
            "bos_token_id": eod, "eos_token_id": eod, "tie_word_embeddings": True}


def t5_hf_config(args: Dict[str, Any], pad: int, eos: int) -> Dict[str, Any]:
    tied = not args.get("untie_embeddings_and_output_weights", False)
    return {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": args["vocab_size"],
            "d_model": args["hidden_size"], "d_kv": args["kv_channels"], "d_ff": args["ffn_hidden_size"],
            "num_layers": args["num_layers"],
            "num_decoder_layers": args.get("decoder_num_layers") or args["num_layers"],
            "num_heads": args["num_attention_heads"],
            "relative_attention_num_buckets": args.get("relative_attention_num_buckets", 32),
            "relative_attention_max_distance": args.get("relative_attention_max_distance", 128),
            "dropout_rate": args["hidden_dropout"], "layer_norm_epsilon": args["layernorm_epsilon"],
            "initializer_factor": 1.0, "feed_forward_proj": args.get("feed_forward_proj", "relu"),
            "is_encoder_decoder": True, "tie_word_embeddings": tied, "scale_decoder_outputs": tied,
            "pad_token_id": pad, "eos_token_id": eos, "decoder_start_token_id": pad}


def generation_config(hf: Dict[str, Any]) -> Dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")
    return {k: hf[k] for k in keys if k in hf}


# --- export: tokenizer files -------------------------------------------------------------------------------
def write_tokenizer(out: str, args: Dict[str, Any], tokenizer, max_length: int) -> List[str]:
    """Tokenizer files transformers' AutoTokenizer loads; returns the names written."""
    extra = args.get("vocab_extra_ids", 0) or 0
    if args["tokenizer_type"] == "GPT2BPETokenizer":
        shutil.copyfile(args["vocab_file"], os.path.join(out, "vocab.json"))
        shutil.copyfile(args["merge_file"], os.path.join(out, "merges.txt"))
        eod = "<|endoftext|>"
        added = {str(i): {"content": f"<extra_id_{k}>", "special": True, "lstrip": False, "rstrip": False,
                          "normalized": False, "single_word": False}
                 for k, i in enumerate(tokenizer.sentinel_ids)}
        write_json(os.path.join(out, "tokenizer_config.json"),
                   {"tokenizer_class": "GPT2Tokenizer", "bos_token": eod, "eos_token": eod, "unk_token": eod,
                    "add_prefix_space": False, "model_max_length": max_length, "added_tokens_decoder": added})
        return ["vocab.json", "merges.txt", "tokenizer_config.json"]
    shutil.copyfile(args["tokenizer_model"], os.path.join(out, "spiece.model"))
    write_json(os.path.join(out, "tokenizer_config.json"),
               {"tokenizer_class": "T5Tokenizer", "extra_ids": extra, "eos_token": "</s>", "unk_token": "<unk>",
                "pad_token": "<pad>", "model_max_length": max_length})
    return ["spiece.model", "tokenizer_config.json"]


def sentinel_order(args: Dict[str, Any], rows: int) -> Optional[List[int]]:
    """Row order mapping this project's ids to T5Tokenizer's (an involution), or None when ids agree:
    HF row r holds our row order[r]."""
    extra = args.get("vocab_extra_ids", 0) or 0
    if args.get("tokenizer_type") != "SentencePieceTokenizer" or extra == 0:
        return None
    base = args["vocab_size"] - extra
    order = list(range(rows))
    order[base:base + extra] = reversed(range(base, base + extra))
    return order


# --- import: HF config -> our arguments --------------------------------------------------------------------
def _unsupported(options: List[str], where: str) -> None:
    if options:
        raise UserError(f"{where} uses options this project's model does not implement: {'; '.join(options)}")


def gpt2_args(cfg: Dict[str, Any], where: str) -> Dict[str, Any]:
    h, heads = cfg.get("n_embd", 768), cfg.get("n_head", 12)
    bad = [f"{k} = {cfg[k]}" for k, ok in (("activation_function", lambda v: v in GELU_TANH),
                                           ("scale_attn_weights", lambda v: v is True),
                                           ("scale_attn_by_inverse_layer_idx", lambda v: v is False),
                                           ("add_cross_attention", lambda v: v is False),
                                           ("tie_word_embeddings", lambda v: v is True)) if k in cfg and not ok(cfg[k])]
    if h % heads:
        bad.append(f"n_embd {h} not divisible by n_head {heads}")
    _unsupported(bad, where)
    positions = cfg.get("n_positions", 1024)
    return dict(model_type="gpt", num_layers=cfg.get("n_layer", 12), hidden_size=h, num_attention_heads=heads,
                ffn_hidden_size=cfg.get("n_inner") or 4 * h, kv_channels=h // heads, max_position_embeddings=positions,
                seq_length=positions, encoder_seq_length=positions, decoder_seq_length=positions,
                layernorm_epsilon=cfg.get("layer_norm_epsilon", 1e-5),
                init_method_std=cfg.get("initializer_range", 0.02),
                hidden_dropout=cfg.get("resid_pdrop", 0.1), attention_dropout=cfg.get("attn_pdrop", 0.1))


def t5_args(cfg: Dict[str, Any], where: str) -> Dict[str, Any]:
    ffn = cfg.get("feed_forward_proj", "relu")
    bad = [] if ffn in T5_FFN else [f"feed_forward_proj = {ffn!r} (supported: {', '.join(T5_FFN)})"]
    if cfg.get("is_encoder_decoder", True) is not True:
        bad.append("is_encoder_decoder = false")
    _unsupported(bad, where)
    scaled = cfg.get("scale_decoder_outputs", cfg.get("tie_word_embeddings", True))
    layers = cfg.get("num_layers", 6)
    return dict(model_type="t5", num_layers=layers, decoder_num_layers=cfg.get("num_decoder_layers") or layers,
                hidden_size=cfg.get("d_model", 512), num_attention_heads=cfg.get("num_heads", 8),
                kv_channels=cfg.get("d_kv", 64), ffn_hidden_size=cfg.get("d_ff", 2048), feed_forward_proj=ffn,
                untie_embeddings_and_output_weights=not scaled,
                relative_attention_num_buckets=cfg.get("relative_attention_num_buckets", 32),
                relative_attention_max_distance=cfg.get("relative_attention_max_distance", 128),
                seq_length=512, encoder_seq_length=512, decoder_seq_length=128, max_position_embeddings=512,
                layernorm_epsilon=cfg.get("layer_norm_epsilon", 1e-6), hidden_dropout=cfg.get("dropout_rate", 0.1),
                attention_dropout=cfg.get("dropout_rate", 0.1), init_method_std=0.02)


def import_tokenizer(hf_dir: str, folder: str) -> Tuple[Dict[str, Any], Optional[object]]:
    """Copy the HF tokenizer files into the checkpoint folder; (tokenizer arguments, tokenizer) or ({}, None)."""
    from megatron.tokenizer import build_tokenizer
    tok_cfg_path = os.path.join(hf_dir, "tokenizer_config.json")
    tok_cfg = read_json(tok_cfg_path) if os.path.isfile(tok_cfg_path) else {}
    if os.path.isfile(os.path.join(hf_dir, "spiece.model")):
        model = os.path.join(folder, "spiece.model")
        shutil.copyfile(os.path.join(hf_dir, "spiece.model"), model)
        extra = tok_cfg.get("extra_ids", _count_sentinels(tok_cfg))
        args = dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=os.path.abspath(model),
                    vocab_file=None, merge_file=None, vocab_extra_ids=extra)
    elif os.path.isfile(os.path.join(hf_dir, "vocab.json")) and os.path.isfile(os.path.join(hf_dir, "merges.txt")):
        for name in ("vocab.json", "merges.txt"):
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(folder, name))
        args = dict(tokenizer_type="GPT2BPETokenizer", vocab_file=os.path.abspath(os.path.join(folder, "vocab.json")),
                    merge_file=os.path.abspath(os.path.join(folder, "merges.txt")), tokenizer_model=None,
                    vocab_extra_ids=_count_sentinels(tok_cfg))
    else:
        return {}, None
    tokenizer = build_tokenizer(args["tokenizer_type"], args["vocab_file"], args["merge_file"],
                                args["tokenizer_model"], args["vocab_extra_ids"])
    return args, tokenizer


def _count_sentinels(tok_cfg: Dict[str, Any]) -> int:
    names = [v.get("content", "") for v in tok_cfg.get("added_tokens_decoder", {}).values()]
    names += [t if isinstance(t, str) else t.get("content", "") for t in tok_cfg.get("additional_special_tokens", [])]
    return len({n for n in names if n.startswith("<extra_id_")})


def layout_args(args: Dict[str, Any], tp: int, pp: int) -> Dict[str, Any]:
    """The layout and run fields a saved megatron_args.json has (a weights-only checkpoint at (tp, pp, 1))."""
    divisible = 128
    return dict(tensor_model_parallel_size=tp, pipe_parallel_size=pp, data_parallel_size=1, world_size=tp * pp,
                make_vocab_size_divisible_by=divisible,
                padded_vocab_size=padded_vocab_size(args["vocab_size"], divisible, tp), partition_method=None,
                micro_batch_size=1, global_batch_size=1, gas=1, zero_stage=1, fp16=False, bf16=False, seed=1234,
                checkpoint_activations=False, checkpoint_num_layers=1,
                ds_config={"zero_optimization": {"stage": 0}, "gradient_accumulation_steps": 1})
