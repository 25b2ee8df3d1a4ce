"""Checkpoint conversion: inspect, reshape to any (tp, pp, dp), Hugging Face export / import, consolidated fp32.

    python tools/convert_checkpoint.py inspect CKPT_DIR [--verify]
    python tools/convert_checkpoint.py reshape --load CKPT_DIR --save OUT_DIR --tensor-model-parallel-size T \\
        --pipe-parallel-size P [--data-parallel-size D] [--no-optimizer]
    python tools/convert_checkpoint.py export-hf --load CKPT_DIR --output HF_DIR [--verify]
    python tools/convert_checkpoint.py import-hf --input HF_DIR --save CKPT_DIR --tensor-model-parallel-size T \\
        --pipe-parallel-size P
    python tools/convert_checkpoint.py to-fp32 --load CKPT_DIR --output FILE(.pt|.safetensors)

CKPT_DIR is a directory written with --save (its `latest` tag is used unless --tag is given) or a tag folder.
Outputs are written under a temporary name and renamed when complete; inputs are only read. The library is
megatron/checkpointing (the same code loads checkpoints in training).
"""
from megatron.checkpointing.cli import main, run  # noqa: F401  (run: the same without the exit-status handling)

if __name__ == "__main__":
    main()
