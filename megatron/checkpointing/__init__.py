"""Checkpoints: one format for every (tp, pp, dp), saved and loaded by training, read and written by the tools.

    files         names, `latest`, megatron_args.json, atomic outputs
    reading       every checkpoint file read: the allowlist, one-line errors, the CRC-32 against manifest.json
    names         per-model name tables: canonical (plain model) names <-> pipeline layer files <-> Pipe module
    tp            tensor-parallel split / merge by partition attributes, vocabulary re-padding
    optim         DeepSpeed's optimizer layouts (ZeRO-1 flat partitions, stage-0 optimizers) <-> one form
    consolidated  any checkpoint -> full tensors by canonical name       layouts  full tensors -> any layout
    reshape       any (tp, pp, dp) -> any other                          weights  weights into any model
    engine_io     save / load during training (reshape on load, --finetune)
    async_save    --async-save: the writes on a background thread, published when every rank's are done
    hf*           Hugging Face transformers export / import     summary: inspect     fp32: to-fp32
    ancestors     the ancestors' GPT checkpoints <-> this format: Megatron-LM's legacy files and torch_dist, DeepSpeed
                  pipeline files (Megatron-DeepSpeed, DeepSpeedExamples, CPM-Pretrain); see its __init__

Every file is read through `reading.load_file` (tds.safe_load: weights_only=True and an allowlist; the CRC-32 that
manifest.json lists checked while reading).

`tools/convert_checkpoint.py` is a thin command line over these modules.
"""
import importlib
from typing import Any

# name -> the module defining it, imported on first use (PEP 562), so that a torch-free module of this package
# (files: `latest` and megatron_args.json) imports without torch and DeepSpeed (the preflight's
# --use-checkpoint-args reads a checkpoint's arguments in about a second)
_EXPORTS = {"wait_for_saves": "async_save"}
_EXPORTS.update({name: "engine_io" for name in ("SHAPE_FIELDS", "check_compatible", "commit", "load_checkpoint",
                                                "load_model_weights", "read_checkpoint_args", "save_checkpoint")})
_EXPORTS.update({name: "files" for name in ("ARGS_FILE", "LATEST", "CheckpointFileError", "CheckpointMismatchError",
                                            "checkpoint_tag", "publish_latest", "read_latest")})
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
