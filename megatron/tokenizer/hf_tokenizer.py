"""A Hugging Face ``tokenizer.json``, read with the ``tokenizers`` library (no transformers, no download).

``--tokenizer-model`` is the tokenizer.json or the folder holding it, as the hub ships a model. Ids are the ones
transformers' ``PreTrainedTokenizerFast`` gives: the tokenizer's encode with its post-processor (Llama's adds
BOS), special tokens written in the text matched as special tokens, no truncation or padding even where
tokenizer.json sets them. ``vocab_size`` counts every id, added tokens included.

Which token is eos, bos and pad: ``tokenizer_config.json`` beside the tokenizer.json names it (``eos_token``,
...), else ``special_tokens_map.json``, else a well-known name in the vocabulary (``WELL_KNOWN``; Llama-3's
base config names ``<|end_of_text|>``, Llama-2's ``</s>``, Qwen2's and GPT-2's ``<|endoftext|>``). eod = eos;
pad = the pad token, else eos; bos may be None. A tokenizer without an eos is refused.

Every file is read as untrusted: a missing, non-JSON or non-tokenizer file is a one-line UserError naming it.
"""
import json
import os
from typing import Dict, List, Optional, Sequence

from megatron.errors import UserError, one_line
from megatron.tokenizer.base import AbstractTokenizer

TOKENIZER_JSON = "tokenizer.json"
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")  # first naming a token wins
WELL_KNOWN = {"eos": ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>"),
              "bos": ("<|begin_of_text|>", "<s>", "<bos>"),
              "pad": ()}


def tokenizer_json_path(tokenizer_model: Optional[str]) -> str:
    """The tokenizer.json that --tokenizer-model names (the file, or the one in the folder)."""
    if not tokenizer_model:
        raise UserError("--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model tokenizer.json (or its folder)")
    if os.path.isdir(tokenizer_model):
        path = os.path.join(tokenizer_model, TOKENIZER_JSON)
        if not os.path.isfile(path):
            files = ", ".join(sorted(os.listdir(tokenizer_model))[:10]) or "none"
            raise UserError(f"--tokenizer-model {tokenizer_model}: the folder holds no {TOKENIZER_JSON} "
                            f"(files: {files})")
        return path
    if not os.path.isfile(tokenizer_model):
        raise UserError(f"--tokenizer-model {tokenizer_model}: file not found")
    return tokenizer_model


def _read_json(path: str, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        obj = json.loads(text)
    except UnicodeDecodeError as e:
        raise UserError(f"{path}: not {what}: not UTF-8 text (byte {e.start})") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not {what}: not JSON (line {e.lineno} column {e.colno}: {e.msg})") from None
    except RecursionError:
        raise UserError(f"{path}: not {what}: JSON nested too deeply") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it: {e.strerror or e}") from None
    if not isinstance(obj, dict):
        raise UserError(f"{path}: not {what}: a JSON {type(obj).__name__}, expected an object")
    return obj


def _check_templates(processor, path: str) -> None:
    """Every special token a TemplateProcessing post-processor writes is in its special_tokens (the library
    panics at the first encode otherwise)."""
    if not isinstance(processor, dict):
        return
    for inner in processor.get("processors") or []:  # a Sequence of post-processors
        _check_templates(inner, path)
    if processor.get("type") != "TemplateProcessing":
        return
    known = processor.get("special_tokens") or {}
    for template in ("single", "pair"):
        for piece in processor.get(template) or []:
            token = piece.get("SpecialToken", {}).get("id") if isinstance(piece, dict) else None
            if token is not None and token not in known:
                raise UserError(f"{path}: not a usable tokenizer.json: the post_processor's {template} template "
                                f"writes {token!r}, which its special_tokens do not define")


def _check_ids(obj: dict, path: str) -> None:
    """The model's vocabulary and the added tokens give ids 0..N-1, each once (what a trained tokenizer writes;
    a changed id leaves a gap and a token outside the embedding's rows)."""
    vocab = obj["model"].get("vocab")
    if not isinstance(vocab, dict):
        return  # a model without a token -> id map (Unigram lists pieces in id order)
    ids = set(vocab.values())
    for added in obj.get("added_tokens") or []:
        if isinstance(added, dict) and isinstance(added.get("id"), int):
            ids.add(added["id"])
    if len(set(vocab.values())) != len(vocab) or not all(isinstance(i, int) for i in ids) or \
            (ids and (min(ids) < 0 or max(ids) >= len(ids))):
        raise UserError(f"{path}: not a usable tokenizer.json: the ids of its {len(vocab)} vocabulary tokens and "
                        f"added tokens are not 0..N-1 once each (largest {max(ids) if ids else None}); the file is "
                        f"damaged")


def load_tokenizer_json(path: str):
    """A ``tokenizers.Tokenizer`` from the file; UserError naming the file when it is not one."""
    from tokenizers import Tokenizer

    obj = _read_json(path, "a tokenizer.json")
    if not isinstance(obj.get("model"), dict):
        raise UserError(f"{path}: not a tokenizer.json: no 'model' object (keys: {', '.join(sorted(obj)) or 'none'})")
    _check_templates(obj.get("post_processor"), path)
    _check_ids(obj, path)
    try:
        tokenizer = Tokenizer.from_file(path)
        tokenizer.encode("a")  # a probe: some inconsistencies only show when encoding
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # parse errors are plain Exceptions, a Rust panic is a BaseException
        raise UserError(f"{path}: not a tokenizer the tokenizers library can load: {one_line(e)}") from None
    tokenizer.no_truncation()
    tokenizer.no_padding()
    return tokenizer


def _config_token(folder: str, role: str) -> Optional[tuple]:
    """(token, file) that the first config file naming ``<role>_token`` gives, or None."""
    for name in CONFIG_FILES:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            continue
        value = _read_json(path, "a tokenizer config").get(f"{role}_token")
        if isinstance(value, dict):  # an AddedToken as saved: {"content": ..., ...}
            value = value.get("content")
        if value is not None:
            if not isinstance(value, str):
                raise UserError(f"{path}: {role}_token is {value!r}, expected a token string")
            return value, path
    return None


def special_token_ids(tokenizer, folder: str) -> Dict[str, Optional[int]]:
    """eos, bos and pad ids (see the module docstring); None where there is none."""
    ids = {}
    for role, names in WELL_KNOWN.items():
        named = _config_token(folder, role)
        if named is not None:
            token, path = named
            ids[role] = tokenizer.token_to_id(token)
            if ids[role] is None:
                raise UserError(f"{path}: {role}_token {token!r} is not in the tokenizer's vocabulary")
            continue
        ids[role] = next((tokenizer.token_to_id(n) for n in names if tokenizer.token_to_id(n) is not None), None)
    return ids


class HuggingFaceTokenizer(AbstractTokenizer):
    """``--tokenizer-type HuggingFaceTokenizer --tokenizer-model DIR_OR_tokenizer.json`` (Megatron-LM's name)."""

    def __init__(self, tokenizer_model: str, vocab_extra_ids: int = 0):
        if vocab_extra_ids:
            raise UserError(f"--vocab-extra-ids {vocab_extra_ids} with HuggingFaceTokenizer: a Hugging Face "
                            f"tokenizer carries its own added tokens; use --vocab-extra-ids 0")
        self.path = tokenizer_json_path(tokenizer_model)
        self._tok = load_tokenizer_json(self.path)
        ids = special_token_ids(self._tok, os.path.dirname(os.path.abspath(self.path)))
        if ids["eos"] is None:
            raise UserError(f"{self.path}: no end-of-sequence token: none of {', '.join(WELL_KNOWN['eos'])} is in "
                            f"its vocabulary and no {CONFIG_FILES[0]} beside it names an eos_token")
        self._eos, self._bos, self._pad = ids["eos"], ids["bos"], ids["pad"]
        largest = max(self._tok.get_vocab(with_added_tokens=True).values())
        super().__init__(max(self._tok.get_vocab_size(with_added_tokens=True), largest + 1), 0)

    def tokenize(self, text: str) -> List[int]:
        return self._tok.encode(text).ids

    def tokenize_continuation(self, text: str) -> List[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=False)

    @property
    def eod(self) -> int:
        return self._eos

    @property
    def eos(self) -> int:
        return self._eos

    @property
    def bos(self) -> Optional[int]:
        return self._bos

    @property
    def pad(self) -> int:
        return self._eos if self._pad is None else self._pad
