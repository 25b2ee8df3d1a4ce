"""Tokenizer files of a Hugging Face folder <-> this project's tokenizer arguments: what import-hf copies into a
checkpoint and export-hf writes beside the weights.

    spiece.model (T5)                       SentencePieceTokenizer, the sentinels transformers would load
    vocab.json + merges.txt (GPT-2)         GPT2BPETokenizer
    tokenizer.json (Llama, Mistral, Qwen2)  HuggingFaceTokenizer over a copy of tokenizer.json and its
                                            tokenizer_config.json / special_tokens_map.json (eos, bos, pad)
A folder with none of them (a save_pretrained of the model alone, or a sentencepiece tokenizer.model without its
tokenizer.json) imports its weights alone, and export then writes no tokenizer files.

T5 sentinels: this project numbers `<extra_id_i>` = V + i after the V sentencepiece pieces (Megatron's
order); transformers' T5Tokenizer numbers them the other way round (`<extra_id_i>` = V + E - 1 - i). Export
with a sentencepiece tokenizer reorders those E rows of the word table (and untied head) so the exported
model and T5Tokenizer agree; import reorders them back (`sentinel_order`). A GPT-2 BPE tokenizer's extra ids
are exported as added tokens with this project's ids, no reordering.
"""
from __future__ import annotations

import os
import re
import shutil
from typing import Any, Dict, List, Optional, Tuple

from megatron.errors import UserError
from ..files import read_json, write_json

SENTINEL = re.compile(r"<extra_id_(\d+)>")
T5_DEFAULT_EXTRA_IDS = 100  # transformers' T5Tokenizer(extra_ids=100)
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _json(path: str) -> Dict[str, Any]:
    """A tokenizer file's JSON object; one line naming the file when it is not one."""
    try:
        obj = read_json(path)
    except (ValueError, OSError) as e:
        raise UserError(f"{path}: not a readable JSON tokenizer file ({e})") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path}: a JSON {type(obj).__name__}, expected an object")
    return obj


def import_tokenizer(hf_dir: str, folder: str) -> Tuple[Dict[str, Any], Optional[object]]:
    """Copy the HF tokenizer files into the checkpoint folder; (tokenizer arguments, tokenizer) or ({}, None).

    The sentinel count is the one transformers would load: the `<extra_id_*>` tokens tokenizer.json (else
    tokenizer_config.json) lists, else tokenizer_config.json's `extra_ids`, else T5Tokenizer's default of
    100 for a sentencepiece model (0 for GPT-2 BPE). Listed ids must follow the numbering `sentinel_order`
    assumes (T5Tokenizer: `<extra_id_k>` = pieces + E - 1 - k; BPE: base + k)."""
    from megatron.tokenizer import build_tokenizer
    tok_cfg_path = os.path.join(hf_dir, "tokenizer_config.json")
    tok_cfg = _json(tok_cfg_path) if os.path.isfile(tok_cfg_path) else {}
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
    elif os.path.isfile(os.path.join(hf_dir, "tokenizer.json")):
        target = os.path.join(folder, "tokenizer")
        os.makedirs(target)
        _copy_hf_tokenizer(hf_dir, target)
        args = dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=os.path.abspath(target), vocab_file=None,
                    merge_file=None, vocab_extra_ids=0)
        return args, build_tokenizer("HuggingFaceTokenizer", tokenizer_model=target)
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
    sources = [[(t.get("content", ""), t.get("id")) for t in _json(tok_json).get("added_tokens", [])]
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


def _copy_hf_tokenizer(src: str, out: str, tokenizer=None) -> List[str]:
    """tokenizer.json with the config files beside it; a minimal tokenizer_config.json naming eos and bos when the
    source has none (`tokenizer` given)."""
    names = [n for n in HF_TOKENIZER_FILES if os.path.isfile(os.path.join(src, n))]
    for name in names:
        shutil.copyfile(os.path.join(src, name), os.path.join(out, name))
    if tokenizer is not None and "tokenizer_config.json" not in names:
        token = tokenizer.detokenize
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": token([tokenizer.eos])}
        if tokenizer.bos is not None:
            config["bos_token"] = token([tokenizer.bos])
        write_json(os.path.join(out, "tokenizer_config.json"), config)
        names.append("tokenizer_config.json")
    return names


def write_tokenizer(out: str, args: Dict[str, Any], tokenizer, max_length: int) -> List[str]:
    """Tokenizer files transformers' AutoTokenizer loads; returns the names written."""
    extra = args.get("vocab_extra_ids", 0) or 0
    if args["tokenizer_type"] == "HuggingFaceTokenizer":
        return _copy_hf_tokenizer(os.path.dirname(tokenizer.path), out, tokenizer)
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
