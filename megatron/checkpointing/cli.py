"""Checkpoint conversion: inspect, reshape to any (tp, pp, dp), Hugging Face and Megatron-LM export / import, fp32.

    python tools/convert_checkpoint.py inspect CKPT_DIR [--verify]
    python tools/convert_checkpoint.py reshape --load CKPT_DIR --save OUT_DIR --tensor-model-parallel-size T \\
        --pipe-parallel-size P [--data-parallel-size D] [--no-optimizer]
    python tools/convert_checkpoint.py export-hf --load CKPT_DIR --output HF_DIR [--verify]
    python tools/convert_checkpoint.py import-hf --input HF_DIR --save CKPT_DIR --tensor-model-parallel-size T \\
        --pipe-parallel-size P
    python tools/convert_checkpoint.py import-megatron --input DIR --save CKPT_DIR --tensor-model-parallel-size T \\
        --pipe-parallel-size P [--qkv-order 0|1|2] [--data-path PREFIX] [--num-attention-heads N] [--vocab-size V]
    python tools/convert_checkpoint.py export-megatron --load CKPT_DIR --output DIR --tensor-model-parallel-size T \\
        --pipe-parallel-size P [--ckpt-format torch|torch_dist]
    python tools/convert_checkpoint.py to-fp32 --load CKPT_DIR --output FILE(.pt|.safetensors)

CKPT_DIR is a directory written with --save (its `latest` tag is used unless --tag is given) or a tag folder.
Every checkpoint file is read with torch.load(weights_only=True) and an allowlist of globals; a file whose pickle
needs anything else is refused in one line naming the file and the global (--trust-checkpoint: trusted files).
Outputs are written under a temporary name and renamed when complete; inputs are only read. The library is
megatron/checkpointing (the same code loads checkpoints in training). The same command line is
`megatron-convert-checkpoint` and `python -m megatron.checkpointing.cli` where the package is installed.
"""

from __future__ import annotations

import argparse
import os
from typing import List, Optional

from megatron.errors import exit_on_user_error


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("inspect", help="model, layout, precision, shapes and files (metadata only)")
    s.add_argument("load", metavar="CKPT_DIR")
    s.add_argument("--tag", default=None)
    s.add_argument("--verify", action="store_true", help="also read every file and compare its CRC-32 with "
                                                         "manifest.json")
    s = sub.add_parser("reshape", help="the checkpoint at another (tp, pp, dp), optimizer state included")
    s.add_argument("--load", required=True, metavar="CKPT_DIR")
    s.add_argument("--save", required=True, metavar="OUT_DIR", help="new directory (must not exist)")
    _layout(s)
    s.add_argument("--data-parallel-size", type=int, default=None, help="default: the saved one")
    s.add_argument("--no-optimizer", action="store_true", help="weights and engine state only (smaller)")
    s.add_argument("--tag", default=None)
    s = sub.add_parser("export-hf", help="to a transformers GPT2LMHeadModel / T5ForConditionalGeneration folder")
    s.add_argument("--load", required=True, metavar="CKPT_DIR")
    s.add_argument("--output", required=True, metavar="HF_DIR", help="new directory (must not exist)")
    s.add_argument("--tag", default=None)
    for name in ("vocab-file", "merge-file", "tokenizer-model"):
        s.add_argument(f"--{name}", default=None, help="override the checkpoint's tokenizer file")
    s.add_argument("--verify", action="store_true", help="load the output with transformers, compare logits")
    s = sub.add_parser("import-hf", help="a transformers folder (GPT-2, T5, Llama, Mistral, Qwen2, Qwen3, OLMo-2: "
                                         "the adapter table) -> a checkpoint to --load")
    s.add_argument("--input", required=True, metavar="HF_DIR")
    s.add_argument("--save", required=True, metavar="CKPT_DIR", help="new directory (must not exist)")
    _layout(s)
    s = sub.add_parser("import-megatron", help="a GPT checkpoint of Megatron-LM (legacy or torch_dist), "
                                               "Megatron-DeepSpeed, DeepSpeedExamples v1.1.5 or CPM-Pretrain -> a "
                                               "checkpoint to --load")
    s.add_argument("--input", required=True, metavar="DIR", help="the source's save directory or iteration folder "
                                                                 "(the format is detected from the files)")
    s.add_argument("--save", required=True, metavar="CKPT_DIR", help="new directory (must not exist)")
    _layout(s)
    s.add_argument("--qkv-order", choices=["0", "1", "2"], default=None,
                   help="the fused QKV rows' order: 0 ([3, np, hn], checkpoint_version 0), 1 ([np, hn, 3], 1.0) or 2 "
                        "([np, 3, hn], 2.0 / 3.0; grouped with GQA); default: the recorded checkpoint_version, else "
                        "the lowest loss on --data-path, else 2")
    s.add_argument("--data-path", default=None, metavar="PREFIX",
                   help="a Megatron dataset (.bin/.idx, the source's tokenizer): report the loss of a few sequences "
                        "under each QKV order and name the plausible one")
    s.add_argument("--num-attention-heads", type=int, default=None,
                   help="heads, for files that record no arguments (DeepSpeedExamples v1.1.5, CPM-Pretrain)")
    s.add_argument("--vocab-size", type=int, default=None,
                   help="the tokenizer's ids (default: the source's vocab_size, else every row of its table)")
    s.add_argument("--gelu", choices=["tanh", "erf"], default=None,
                   help="override the GELU read from the source's arguments (--openai-gelu, --bias-gelu-fusion)")
    s = sub.add_parser("export-megatron", help="a GPT checkpoint -> Megatron-LM's legacy format (checkpoint_version "
                                               "3.0) at any (tp, pp), or Megatron core's torch_dist")
    s.add_argument("--load", required=True, metavar="CKPT_DIR")
    s.add_argument("--output", required=True, metavar="DIR", help="new directory (must not exist)")
    _layout(s)
    s.add_argument("--ckpt-format", choices=["torch", "torch_dist"], default="torch",
                   help="Megatron-LM's name for the format: torch (legacy, one file per tp x pp rank; the default) or "
                        "torch_dist (Megatron core's distributed checkpoint: global tensors that Megatron-LM loads "
                        "at any tp and pp; --tensor-model-parallel-size sets the vocabulary padding it records)")
    s.add_argument("--tag", default=None)
    s = sub.add_parser("to-fp32", help="one consolidated fp32 state dict of the plain model (tp = 1)")
    s.add_argument("--load", required=True, metavar="CKPT_DIR")
    s.add_argument("--output", required=True, metavar="FILE")
    s.add_argument("--tag", default=None)
    for s in sub.choices.values():
        s.add_argument("--trust-checkpoint", action="store_true",
                       help="read the input's pickles with torch.load(weights_only=False), only for files from a "
                            "source you trust (a pickle can run any code); by default they are read with "
                            "weights_only=True and an allowlist, and a file needing more is refused in one line")
    return p


def _layout(s: argparse.ArgumentParser) -> None:
    s.add_argument("--tensor-model-parallel-size", "--target-tensor-parallel-size", type=int, required=True)
    s.add_argument("--pipe-parallel-size", "--target-pipeline-parallel-size", type=int, required=True)


def run(argv: Optional[List[str]] = None) -> None:
    """Parse `argv` and run one subcommand (what `main` does, without the exit-status handling)."""
    args = _parser().parse_args(argv)
    from megatron.checkpointing.files import show_progress
    from tds.safe_load import trusted
    show_progress(True)
    with trusted(args.trust_checkpoint):
        COMMANDS[args.command](args)


def _inspect(args) -> None:
    from megatron.checkpointing.summary import inspect_lines
    print("\n".join(inspect_lines(args.load, args.tag, args.verify)))


def _reshape(args) -> None:
    from megatron.checkpointing.reshape import reshape
    r = reshape(args.load, args.save, args.tensor_model_parallel_size, args.pipe_parallel_size,
                args.data_parallel_size, args.no_optimizer, args.tag)
    print(f"reshaped {r.tag} from (tp, pp, dp) = {r.source} to {r.target} into {args.save} "
          f"({r.source_bytes / 1e6:.1f} MB checkpoint, {r.seconds:.1f} s)")
    if r.note:
        print(r.note)


def _export(args) -> None:
    from megatron.checkpointing.hf import export_hf
    overrides = dict(vocab_file=args.vocab_file, merge_file=args.merge_file, tokenizer_model=args.tokenizer_model)
    report = export_hf(args.load, args.output, args.tag, overrides)
    print(f"exported {report.model_type} ({report.parameters:,} parameters) to {args.output}: "
          f"{', '.join(report.files)}")
    if report.note:
        print(report.note)
    if args.verify:
        from megatron.checkpointing.hf import verify_export
        difference = verify_export(args.load, args.output, args.tag)
        print(f"verified with transformers: logits max relative difference {difference:.2e}")


def _import(args) -> None:
    from megatron.checkpointing.hf import IMPORT_TAG, import_hf
    saved = import_hf(args.input, args.save, args.tensor_model_parallel_size, args.pipe_parallel_size)
    from megatron.checkpointing.flags import model_flags
    print(f"imported {saved['model_type']} into {args.save}/{IMPORT_TAG} at (tp, pp) = "
          f"({args.tensor_model_parallel_size}, {args.pipe_parallel_size}), weights only: --load {args.save} "
          f"(or --pretrained-checkpoint {args.save}) starts at iteration 0 with a fresh optimizer")
    print(f"model flags: {' '.join(model_flags(saved))}")
    from megatron.model.specs import spec_for
    script = spec_for(saved["model_type"]).example_script(saved)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    script = os.path.join(repo, "examples", script) if os.path.isdir(os.path.join(repo, "examples")) else script
    print(f"continue pretraining it: PRETRAINED={args.save} bash {script} (the scripts pass "
          f"--pretrained-checkpoint {args.save} --use-checkpoint-args: the model flags come from the checkpoint)")
    if saved.get("tokenizer_type"):
        files = ([saved["tokenizer_model"]] if saved["tokenizer_model"] else [saved["vocab_file"], saved["merge_file"]])
        print(f"tokenizer: --tokenizer-type {saved['tokenizer_type']} with {', '.join(files)}"
              + (f" --vocab-extra-ids {saved['vocab_extra_ids']}" if saved.get("vocab_extra_ids") else ""))
    else:
        print(f"tokenizer: none in {args.input} (no spiece.model, nor vocab.json with merges.txt), so export-hf "
              f"will write none; to train with one, add its files to {args.input} and import again")
    vocab, rows, extra = saved["vocab_size"], saved["hf_vocab_size"], saved.get("vocab_extra_ids") or 0
    sentinels = f" ({vocab - extra} base ids + {extra} sentinels <extra_id_*>)" if extra else ""
    padding = f"; the HF table's other {rows - vocab} rows are kept as padding" if rows > vocab else ""
    print(f"vocabulary: {vocab} ids{sentinels}{padding}, padded to {saved['padded_vocab_size']}")


def _import_megatron(args) -> None:
    from megatron.checkpointing.flags import model_flags
    from megatron.checkpointing.ancestors.args import ImportOptions
    from megatron.checkpointing.ancestors.importer import import_megatron
    opts = ImportOptions(num_attention_heads=args.num_attention_heads, vocab_size=args.vocab_size, gelu=args.gelu,
                         qkv_order=args.qkv_order)
    r = import_megatron(args.input, args.save, args.tensor_model_parallel_size, args.pipe_parallel_size, opts,
                        args.data_path)
    print(f"imported {r.fmt} into {args.save}/{r.tag} at (tp, pp) = ({args.tensor_model_parallel_size}, "
          f"{args.pipe_parallel_size})")
    print("\n".join(r.lines))
    print(f"model flags: {' '.join(model_flags(r.args))}")


def _export_megatron(args) -> None:
    from megatron.checkpointing.ancestors.export import export_megatron
    name = export_megatron(args.load, args.output, args.tensor_model_parallel_size, args.pipe_parallel_size, args.tag,
                           args.ckpt_format)
    what = ("Megatron core's torch_dist format" if args.ckpt_format == "torch_dist" else
            "Megatron-LM's legacy format (checkpoint_version 3.0)")
    print(f"exported to {what} at (tp, pp) = ({args.tensor_model_parallel_size}, {args.pipe_parallel_size}): "
          f"{args.output}/{name}; Megatron-LM loads it with --load {args.output} --ckpt-format {args.ckpt_format} "
          f"--use-checkpoint-args --no-load-optim --no-load-rng")


def _to_fp32(args) -> None:
    from megatron.checkpointing.fp32 import to_fp32
    state = to_fp32(args.load, args.output, args.tag)
    print(f"wrote {len(state)} fp32 tensors ({sum(t.numel() for t in state.values()):,} parameters) to {args.output}")


COMMANDS = {"inspect": _inspect, "reshape": _reshape, "export-hf": _export, "import-hf": _import,
            "import-megatron": _import_megatron, "export-megatron": _export_megatron, "to-fp32": _to_fp32}


def main() -> None:
    exit_on_user_error(run)


if __name__ == "__main__":
    main()
