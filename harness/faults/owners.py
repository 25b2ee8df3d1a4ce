"""Each file kind read by its owner's own reader, independently of this project's loaders: what a mutated file
says, so that the campaign can tell a file the project must follow (an edit) from one it must refuse.

    read_json(path)           json (megatron_args.json, manifest.json, HF config.json)
    read_deepspeed_json(path) json, then DeepSpeed's own DeepSpeedConfig (its pydantic sections refuse unknown keys)
    read_text(path)           `latest`: the tag it names
    read_safetensors(path)    safetensors' safe_open: metadata, then each tensor (dtype, shape, CRC-32)
    bpe_tokenizer(folder)     tokenizers' ByteLevelBPETokenizer over bpe/vocab.json and bpe/merges.txt
    spm_tokenizer(folder)     sentencepiece's SentencePieceProcessor over spm/spm.model (spm_model_proto: its
                              protobuf, for reports)
    hf_tokenizer(folder)      tokenizers' Tokenizer over hf/tokenizer.json, with hf/tokenizer_config.json's tokens

Each raises OwnerRefuses when its reader refuses the file. A tokenizer reading has `result(texts)`, in the form of
results.tokenizer_result, with the special ids this project's tokenizer of that kind defines (its docstrings):
GPT-2 BPE: eod = eos = pad = <|endoftext|>; SentencePiece: eod = eos, pad (else eos), unk, sentinels after the
pieces; tokenizer.json: eod = eos = tokenizer_config.json's eos_token, bos its bos_token, pad (else eos).
"""
from __future__ import annotations

import json
import os
import zlib
from typing import Any, Dict, List, Optional, Sequence

from harness.faults.results import SPECIAL, spm_pieces


class OwnerRefuses(Exception):
    """The owner's reader refuses the file."""


def read_json(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return json.loads(f.read().decode("utf-8"))
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise OwnerRefuses(f"json: {err}") from None


def read_deepspeed_json(path: str) -> Any:
    """The JSON, once DeepSpeed's DeepSpeedConfig (one process, world size 1) has accepted it."""
    import copy
    from deepspeed.runtime.config import DeepSpeedConfig
    config = read_json(path)
    try:
        DeepSpeedConfig(copy.deepcopy(config))
    except Exception as err:  # noqa: BLE001 - pydantic's ValidationError, DeepSpeed's own asserts
        raise OwnerRefuses(f"DeepSpeed: {' | '.join(str(err).splitlines()[:2])}") from None
    return config


def read_text(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8").strip()
    except UnicodeDecodeError as err:
        raise OwnerRefuses(f"not UTF-8: {err}") from None


def read_safetensors(path: str) -> Dict[str, Any]:
    from safetensors import safe_open
    try:
        with safe_open(path, framework="np") as f:
            tensors = {k: f.get_tensor(k) for k in sorted(f.keys())}
            metadata = f.metadata()
    except Exception as err:  # noqa: BLE001 - SafetensorError and the like: the owner refuses
        raise OwnerRefuses(f"safetensors: {err}") from None
    return dict(metadata=metadata, tensors={k: [str(v.dtype), list(v.shape), zlib.crc32(v.tobytes())]
                                            for k, v in tensors.items()})


class _Tokenizer:
    """A tokenizer as its owner reads it: ids of texts and the special ids."""

    def __init__(self, encode, decode, vocab_size: int, special: Dict[str, Optional[int]], extra_ids: int = 0,
                 pieces: Optional[list] = None):
        self.encode, self.decode, self.vocab_size, self.pieces = encode, decode, vocab_size + extra_ids, pieces
        self.special = {name: special.get(name) for name in SPECIAL}
        self.special["sentinel_ids"] = list(range(vocab_size, vocab_size + extra_ids))

    def result(self, texts: Sequence[str]) -> dict:
        try:
            ids = [list(self.encode(t)) for t in texts]
        except BaseException as err:  # noqa: BLE001 - a Rust panic is a BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            raise OwnerRefuses(f"encoding: {err}") from None
        return dict(vocab_size=self.vocab_size, special=dict(self.special), ids=ids, pieces=self.pieces)

    def vocabulary_texts(self) -> List[str]:
        """The text of every id: encoding them exercises every piece and merge of the vocabulary."""
        return [self.decode([i]) for i in range(self.vocab_size - len(self.special["sentinel_ids"]))]


def bpe_tokenizer(folder: str) -> _Tokenizer:
    from tokenizers import ByteLevelBPETokenizer
    vocab, merges = os.path.join(folder, "bpe", "vocab.json"), os.path.join(folder, "bpe", "merges.txt")
    try:
        tok = ByteLevelBPETokenizer(vocab, merges, add_prefix_space=False)
    except Exception as err:  # noqa: BLE001
        raise OwnerRefuses(f"tokenizers: {err}") from None
    eod = tok.token_to_id("<|endoftext|>")
    return _Tokenizer(lambda t: tok.encode(t).ids, lambda ids: tok.decode(ids, skip_special_tokens=False),
                      tok.get_vocab_size(), dict(eod=eod, eos=eod, pad=eod))


def spm_tokenizer(folder: str, extra_ids: int) -> _Tokenizer:
    import sentencepiece
    try:
        sp = sentencepiece.SentencePieceProcessor(model_file=os.path.join(folder, "spm", "spm.model"))
    except Exception as err:  # noqa: BLE001
        raise OwnerRefuses(f"sentencepiece: {err}") from None
    eos = sp.eos_id()
    special = dict(eod=eos, eos=eos, pad=sp.pad_id() if sp.pad_id() >= 0 else eos, unk=sp.unk_id())
    return _Tokenizer(lambda t: sp.encode(t, out_type=int), lambda ids: sp.decode(ids), sp.get_piece_size(),
                      special, extra_ids, spm_pieces(sp))


def spm_model_proto(folder: str) -> Dict[str, Any]:
    """The ModelProto's pieces (piece, score, type) and its specs, as sentencepiece's protobuf parses them: what
    a report names as the change."""
    from sentencepiece import sentencepiece_model_pb2
    model = sentencepiece_model_pb2.ModelProto()
    try:
        with open(os.path.join(folder, "spm", "spm.model"), "rb") as f:
            model.ParseFromString(f.read())
    except Exception as err:  # noqa: BLE001 - DecodeError
        raise OwnerRefuses(f"protobuf: {err}") from None
    return dict(pieces=[[p.piece, p.score, int(p.type)] for p in model.pieces],
                trainer_spec=str(model.trainer_spec), normalizer_spec=str(model.normalizer_spec))


def hf_tokenizer(folder: str) -> _Tokenizer:
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(os.path.join(folder, "hf", "tokenizer.json"))
    except BaseException as err:  # noqa: BLE001 - a Rust panic is a BaseException
        if isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise
        raise OwnerRefuses(f"tokenizers: {err}") from None
    config = read_json(os.path.join(folder, "hf", "tokenizer_config.json"))
    named = {role: tok.token_to_id(config[f"{role}_token"]) if f"{role}_token" in config else None
             for role in ("eos", "bos", "pad")}
    eos = named["eos"]
    special = dict(eod=eos, eos=eos, bos=named["bos"], pad=eos if named["pad"] is None else named["pad"])
    return _Tokenizer(lambda t: tok.encode(t).ids, lambda ids: tok.decode(ids, skip_special_tokens=False),
                      tok.get_vocab_size(with_added_tokens=True), special)
