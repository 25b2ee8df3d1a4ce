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
import re
import shutil
from typing import Any, Dict, List, Optional, Tuple

from megatron.errors import UserError
from megatron.model.config import padded_vocab_size

SENTINEL = re.compile(r"<extra_id_(\d+)>")
T5_DEFAULT_EXTRA_IDS = 100  # transformers' T5Tokenizer(extra_ids=100)
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
def hf_rows(args: Dict[str, Any]) -> int:
    """Rows of the exported word table: config.json's vocab_size of an imported folder (its padding rows
    included), else the tokenizer's vocabulary."""
    return args.get("hf_vocab_size") or args["vocab_size"]


def token_ids(args: Dict[str, Any], tokenizer) -> Dict[str, int]:
    """config.json's special token ids: the tokenizer's, else (imported without a tokenizer) the HF folder's."""
    if tokenizer is None:
        return dict(args.get("hf_token_ids") or {})
    if args["model_type"] == "gpt":
        return {"bos_token_id": tokenizer.eod, "eos_token_id": tokenizer.eod}
    return {"pad_token_id": tokenizer.pad, "eos_token_id": tokenizer.eos, "decoder_start_token_id": tokenizer.pad}


GPT2_LAYER = dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                  group_query_attention=False, disable_bias_linear=False, add_qkv_bias=False,
                  untie_embeddings_and_output_weights=False, gelu="tanh")


def gpt2_hf_config(args: Dict[str, Any], ids: Dict[str, int]) -> Dict[str, Any]:
    h, heads = args["hidden_size"], args["num_attention_heads"]
    other = [f"{k} = {args[k]}" for k, v in GPT2_LAYER.items() if args.get(k) not in (None, v)]
    if other:
        raise UserError(f"export-hf: a GPT with {', '.join(other)} is neither GPT2LMHeadModel nor of the Llama "
                        f"family (which needs --position-embedding-type rope); it has no transformers architecture")
    if args["kv_channels"] * heads != h:
        raise UserError(f"export-hf: kv_channels {args['kv_channels']} x heads {heads} != hidden_size {h}; "
                        f"GPT2LMHeadModel needs head width = hidden / heads")
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": hf_rows(args),
            "n_positions": args["max_position_embeddings"], "n_embd": h, "n_layer": args["num_layers"],
            "n_head": heads, "n_inner": args["ffn_hidden_size"], "activation_function": "gelu_new",
            "resid_pdrop": args["hidden_dropout"], "embd_pdrop": args["hidden_dropout"],
            "attn_pdrop": args["attention_dropout"], "layer_norm_epsilon": args["layernorm_epsilon"],
            "initializer_range": args.get("init_method_std", 0.02), "scale_attn_weights": True,
            "tie_word_embeddings": True, **ids}


def t5_hf_config(args: Dict[str, Any], ids: Dict[str, int]) -> Dict[str, Any]:
    tied = not args.get("untie_embeddings_and_output_weights", False)
    return {"architectures": ["T5ForConditionalGeneration"], "model_type": "t5", "vocab_size": hf_rows(args),
            "d_model": args["hidden_size"], "d_kv": args["kv_channels"], "d_ff": args["ffn_hidden_size"],
            "num_layers": args["num_layers"],
            "num_decoder_layers": args.get("decoder_num_layers") or args["num_layers"],
            "num_heads": args["num_attention_heads"],
            "relative_attention_num_buckets": args.get("relative_attention_num_buckets", 32),
            "relative_attention_max_distance": args.get("relative_attention_max_distance", 128),
            "dropout_rate": args["hidden_dropout"], "layer_norm_epsilon": args["layernorm_epsilon"],
            "initializer_factor": 1.0, "feed_forward_proj": args.get("feed_forward_proj", "relu"),
            "is_encoder_decoder": True, "tie_word_embeddings": tied, "scale_decoder_outputs": tied, **ids}


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
    """Copy the HF tokenizer files into the checkpoint folder; (tokenizer arguments, tokenizer) or ({}, None).

    The sentinel count is the one transformers would load: the `<extra_id_*>` tokens tokenizer.json (else
    tokenizer_config.json) lists, else tokenizer_config.json's `extra_ids`, else T5Tokenizer's default of
    100 for a sentencepiece model (0 for GPT-2 BPE). Listed ids must follow the numbering `sentinel_order`
    assumes (T5Tokenizer: `<extra_id_k>` = pieces + E - 1 - k; BPE: base + k)."""
    from megatron.tokenizer import build_tokenizer
    tok_cfg_path = os.path.join(hf_dir, "tokenizer_config.json")
    tok_cfg = read_json(tok_cfg_path) if os.path.isfile(tok_cfg_path) else {}
    listed = _listed_sentinels(hf_dir, tok_cfg)
    if os.path.isfile(os.path.join(hf_dir, "spiece.model")):
        model = os.path.join(folder, "spiece.model")
        shutil.copyfile(os.path.join(hf_dir, "spiece.model"), model)
        extra = len(listed) if listed else tok_cfg.get("extra_ids", T5_DEFAULT_EXTRA_IDS)
        args = dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=os.path.abspath(model),
                    vocab_file=None, merge_file=None, vocab_extra_ids=extra)
    elif os.path.isfile(os.path.join(hf_dir, "vocab.json")) and os.path.isfile(os.path.join(hf_dir, "merges.txt")):
        for name in ("vocab.json", "merges.txt"):
            shutil.copyfile(os.path.join(hf_dir, name), os.path.join(folder, name))
        args = dict(tokenizer_type="GPT2BPETokenizer", vocab_file=os.path.abspath(os.path.join(folder, "vocab.json")),
                    merge_file=os.path.abspath(os.path.join(folder, "merges.txt")), tokenizer_model=None,
                    vocab_extra_ids=len(listed))
    else:
        return {}, None
    tokenizer = build_tokenizer(args["tokenizer_type"], args["vocab_file"], args["merge_file"],
                                args["tokenizer_model"], args["vocab_extra_ids"])
    _check_sentinel_ids(listed, args, tokenizer, hf_dir)
    return args, tokenizer


def _listed_sentinels(hf_dir: str, tok_cfg: Dict[str, Any]) -> Dict[int, Optional[int]]:
    """{k: HF id of <extra_id_k>} from tokenizer.json's added tokens, else tokenizer_config.json's
    added_tokens_decoder, else its special-token lists (ids unknown: None); {} when none lists a sentinel."""
    tok_json = os.path.join(hf_dir, "tokenizer.json")
    sources = [[(t.get("content", ""), t.get("id")) for t in read_json(tok_json).get("added_tokens", [])]
               if os.path.isfile(tok_json) else [],
               [(v.get("content", ""), int(i)) for i, v in tok_cfg.get("added_tokens_decoder", {}).items()],
               [(t if isinstance(t, str) else t.get("content", ""), None)
                for key in ("additional_special_tokens", "extra_special_tokens") for t in tok_cfg.get(key) or []]]
    for tokens in sources:
        found = {}
        for name, hf_id in tokens:
            match = SENTINEL.fullmatch(name)
            if match:
                found[int(match.group(1))] = hf_id
        if found:
            return found
    return {}


def _check_sentinel_ids(listed: Dict[int, Optional[int]], args: Dict[str, Any], tokenizer, where: str) -> None:
    extra = args["vocab_extra_ids"]
    if listed and sorted(listed) != list(range(extra)):
        raise UserError(f"{where}: the tokenizer lists sentinels <extra_id_k> for k in {sorted(listed)}, not 0 .. "
                        f"{extra - 1}; this project numbers {extra} sentinels from 0")
    base = tokenizer.vocab_size - extra
    reverse = args["tokenizer_type"] == "SentencePieceTokenizer"
    for k, hf_id in sorted(listed.items()):
        expected = base + extra - 1 - k if reverse else base + k
        if hf_id is not None and hf_id != expected:
            raise UserError(f"{where}: <extra_id_{k}> has id {hf_id}, but after the tokenizer's {base} base ids "
                            f"{'T5Tokenizer numbers it' if reverse else 'it is numbered'} {expected}; import-hf "
                            f"reads sentinels only in that numbering")


def layout_args(args: Dict[str, Any], tp: int, pp: int) -> Dict[str, Any]:
    """The layout and run fields a saved megatron_args.json has (a weights-only checkpoint at (tp, pp, 1)).
    The padded vocabulary holds every row of the HF table (`hf_rows` >= vocab_size)."""
    divisible = 128
    return dict(tensor_model_parallel_size=tp, pipe_parallel_size=pp, data_parallel_size=1, world_size=tp * pp,
                make_vocab_size_divisible_by=divisible,
                padded_vocab_size=padded_vocab_size(hf_rows(args), divisible, tp), partition_method=None,
                micro_batch_size=1, global_batch_size=1, gas=1, zero_stage=1, fp16=False, bf16=False, seed=1234,
                checkpoint_activations=False, checkpoint_num_layers=1,
                ds_config={"zero_optimization": {"stage": 0}, "gradient_accumulation_steps": 1})
