"""Hugging Face config.json / generation_config.json <-> this project's saved arguments (GPT-2 and T5; the Llama
family in `hf_llama`, tokenizer files in `hf_tokenizer_files`).

Written and read as plain JSON, so export needs no `transformers` (only `safetensors`).
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List

from megatron.errors import UserError
from megatron.model.config import padded_vocab_size
from megatron.model.specs.gpt import LAYER_SWITCHES

GELU_TANH = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
T5_FFN = ("relu", "gated-gelu")


def read_json(path: str) -> Dict[str, Any]:
    """A JSON object from `path`; UserError naming the file when it is not one (damaged, cut short)."""
    try:
        with open(path, "rb") as f:
            obj = json.loads(f.read().decode("utf-8"))
    except ValueError as err:  # JSONDecodeError and UnicodeDecodeError
        raise UserError(f"{path} is not valid JSON ({type(err).__name__}: {str(err)[:120]}); the file is damaged "
                        f"or cut short") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path} holds a JSON {type(obj).__name__}, not an object")
    return obj


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
        bos = getattr(tokenizer, "bos", None)
        return {"bos_token_id": tokenizer.eod if bos is None else bos, "eos_token_id": tokenizer.eod}
    return {"pad_token_id": tokenizer.pad, "eos_token_id": tokenizer.eos, "decoder_start_token_id": tokenizer.pad}


GPT2_LAYER = dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                  group_query_attention=False, disable_bias_linear=False, add_qkv_bias=False,
                  untie_embeddings_and_output_weights=False, gelu="tanh", **dict.fromkeys(LAYER_SWITCHES, False))


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
