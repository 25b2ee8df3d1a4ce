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
    hf            Hugging Face transformers export / import: one adapter per architecture (hf/gpt2.py, t5.py,
                  llama.py) in one table, `hf.ADAPTERS`        summary: inspect     fp32: to-fp32
    ancestors     the ancestors' GPT checkpoints <-> this format: Megatron-LM's legacy files and torch_dist, DeepSpeed
                  pipeline files (Megatron-DeepSpeed, DeepSpeedExamples, CPM-Pretrain); see its __init__

Every file is read through `reading.load_file` (tds.safe_load: weights_only=True and an allowlist; the CRC-32 that
manifest.json lists checked while reading).

`tools/convert_checkpoint.py` is a thin command line over these modules.
"""
from tds.lazy import lazy_exports

# the names below import on first use (tds/lazy.py): the HF adapters' config.json <-> arguments import without torch
__getattr__ = lazy_exports(__name__, {
    "wait_for_saves": "megatron.checkpointing.async_save",
    **dict.fromkeys(("SHAPE_FIELDS", "check_compatible", "commit", "load_checkpoint", "load_model_weights",
                     "read_checkpoint_args", "save_checkpoint"), "megatron.checkpointing.engine_io"),
    **dict.fromkeys(("ARGS_FILE", "LATEST", "CheckpointFileError", "CheckpointMismatchError", "checkpoint_tag",
                     "publish_latest", "read_latest"), "megatron.checkpointing.files")})
