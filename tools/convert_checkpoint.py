"""Checkpoint conversion: inspect, reshape to any (tp, pp, dp), Hugging Face and Megatron-LM export / import, fp32.

    python tools/convert_checkpoint.py {inspect,reshape,export-hf,import-hf,import-megatron,export-megatron,to-fp32} --help

The command line is `megatron.checkpointing.cli` (its docstring lists every subcommand); the library is
megatron/checkpointing, the same code that loads checkpoints in training.
"""
from megatron.checkpointing.cli import main, run  # noqa: F401  (run: the same without the exit-status handling)

if __name__ == "__main__":
    main()
