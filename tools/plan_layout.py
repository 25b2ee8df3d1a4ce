"""Will it fit, and which layout is fastest: rank every layout of a cluster by predicted memory and step time.

    python tools/plan_layout.py --model gpt --num-layers 24 --hidden-size 1024 --num-attention-heads 16 \
        --seq-length 1024 --global-batch-size 512 --bf16 --nodes 1 --gpus-per-node 8 --gpu h100
    python tools/plan_layout.py --load CHECKPOINT_DIR --global-batch-size 512 --gpu a100-80
    python tools/plan_layout.py --hf-config config.json --global-batch-size 256 --gpu-memory-gb 24 --json

The model takes pretrain_*.py's own flags (megatron.config.arguments, the GPT layer's --swiglu,
--group-query-attention, ... included), a checkpoint's megatron_args.json (--load) or a Hugging Face config.json
(--hf-config: a model_type of the adapter table, megatron.checkpointing.hf.ADAPTERS). GPUs (--gpu): a100-80 (80 GB, 312 TFLOP/s bf16, NVLink
300 GB/s, 25 GB/s per GPU between nodes), a100-40, h100 (80 GB, 989 TFLOP/s, 450 GB/s, 50 GB/s), rtx4090 and
a10 (24 GB); --gpu-memory-gb, --peak-tflops, --intra-node-gbps, --inter-node-gbps override them.
The formulas are in megatron/planning/ (memory.py, activations.py, speed.py); every figure is a prediction.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from megatron.checkpointing.files import read_json
from megatron.checkpointing.hf import ADAPTERS, adapter_for
from megatron.config.arguments import build_parser
from megatron.config.checkpoint_args import ARCHITECTURE, SEQUENCE
from megatron.config.resolution import resolve_model
from megatron.errors import UserError, exit_on_user_error
from megatron.model.specs import SPECS, spec_for
from megatron.model.specs.gpt import GPT_DEFAULTS
from megatron.planning.model_shape import ModelShape
from megatron.planning.report import as_json, table
from megatron.planning.search import rank_layouts
from megatron.planning.speed import GPUS, Cluster

# config.json's model_type -> the arguments import-hf gives its model (megatron/checkpointing/hf.py's readers)
DEFAULT_SEQ = 1024


def _planner_args(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    g = p.add_argument_group("planner")
    g.add_argument("--model", choices=sorted(SPECS), default="gpt", help="model type of the flags")
    g.add_argument("--hf-config", default=None, help=f"a Hugging Face config.json ({', '.join(ADAPTERS)})")
    g.add_argument("--vocab-size", type=int, default=None, help="tokenizer vocabulary (default: the family's "
                   f"reference tokenizer: {', '.join(f'{k} {v.reference_vocab_size}' for k, v in SPECS.items())})")
    g.add_argument("--nodes", type=int, default=1)
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--gpu", choices=sorted(GPUS), default="h100", help="memory, peak and links (below)")
    g.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak per GPU")
    g.add_argument("--intra-node-gbps", type=float, default=None, help="GB/s between GPUs of a node")
    g.add_argument("--inter-node-gbps", type=float, default=None, help="GB/s per GPU between nodes")
    g.add_argument("--efficiency", type=float, default=Cluster.efficiency,
                   help="achieved fraction of the peak (default %(default)s, megatron/planning/speed.py)")
    g.add_argument("--allocator-overhead", type=float, default=Cluster.allocator_overhead,
                   help="memory lost to fragmentation (default %(default)s)")
    g.add_argument("--hop-latency-ms", type=float, default=Cluster.hop_latency_ms,
                   help="one pipeline message besides its bytes (default %(default)s)")
    g.add_argument("--instruction-ms", type=float, default=Cluster.instruction_ms,
                   help="one pipeline send or receive instruction (default %(default)s)")
    g.add_argument("--no-sequence-parallel", action="store_true", help="leave SP out of the search")
    g.add_argument("--top", type=int, default=20, help="rows printed (default %(default)s)")
    g.add_argument("--json", action="store_true", help="all candidates as JSON")
    return _grouped_help(p)


# --help lists the options planning reads, in these groups, with short lines (None: the option's own help); the other
# training flags are accepted (a pretrain_*.py command line plans as it is) and not listed.
HELP_GROUPS = {
    "model shape (or --load CKPT, or --hf-config)": {
        "--model": None, "--hf-config": None, "--load": "a checkpoint: its megatron_args.json",
        "--num-layers": "T5: the encoder's (and the decoder's unless --decoder-num-layers)",
        "--decoder-num-layers": None, "--hidden-size": None, "--num-attention-heads": None,
        "--ffn-hidden-size": "default 4 h (--swiglu: Megatron's 2/3 rule)", "--kv-channels": "default h / heads",
        "--seq-length": None, "--vocab-size": None, "--swiglu": "the gated MLP of the Llama family",
        "--group-query-attention": "with --num-query-groups G", "--num-query-groups": None,
        "--untie-embeddings-and-output-weights": "a separate output layer"},
    "batch and precision": {"--global-batch-size": "split into micro-batch x gas x dp", "--bf16": None,
                            "--fp16": None, "--no-sequence-parallel": None},
    "cluster": {"--nodes": None, "--gpus-per-node": None, "--gpu": None, "--gpu-memory-gb": "override --gpu's",
                "--peak-tflops": None, "--intra-node-gbps": None, "--inter-node-gbps": None, "--efficiency": None,
                "--allocator-overhead": None, "--hop-latency-ms": None, "--instruction-ms": None},
    "output": {"--top": None, "--json": None},
}


def _grouped_help(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The parser with --help showing HELP_GROUPS only; every other option stays accepted, its help suppressed."""
    by_flag = {flag: a for a in p._actions for flag in a.option_strings}
    shown = {flag: by_flag[flag] for flags in HELP_GROUPS.values() for flag in flags}
    for a in set(p._actions) - set(shown.values()) - {by_flag["-h"]}:
        a.help = argparse.SUPPRESS
    p._action_groups[:] = [g for g in p._action_groups if "-h" in (o for a in g._group_actions for o in a.option_strings)]
    for title, flags in HELP_GROUPS.items():
        group = p.add_argument_group(title)
        for flag, text in flags.items():
            action = shown[flag]
            action.help = text or action.help
            if action.nargs != 0 and not action.choices:
                action.metavar = action.metavar or {int: "N", float: "F"}.get(action.type, "PATH")
            action.option_strings = [flag]  # aliases (--ff-hidden-size) stay accepted: the parser's own map keeps them
            group._group_actions.append(action)
    p.usage = "plan_layout.py (MODEL FLAGS | --load CKPT | --hf-config config.json) --global-batch-size N [CLUSTER]"
    p.description = __doc__.split("\n\n")[0]
    p.formatter_class = lambda prog: argparse.HelpFormatter(prog, max_help_position=40, width=118)
    p.epilog = "--gpu (memory GB / dense bf16 TFLOP/s / intra-node GB/s / inter-node GB/s per GPU): " + "; ".join(
        f"{k} {v[0]:g}/{v[1]:g}/{v[2]:g}/{v[3]:g}" for k, v in sorted(GPUS.items()))
    return p


def _hf_fields(a: argparse.Namespace) -> dict:
    """The arguments import-hf gives the model of config.json (its adapter's, `megatron.checkpointing.hf`) and its
    vocabulary; the sequence lengths the command line gives replace its (T5's decoder: --decoder-seq-length, else
    the encoder's)."""
    cfg = read_json(a.hf_config)
    fields = dict(adapter_for(cfg, a.hf_config, "--hf-config").project_args(cfg, a.hf_config),
                  vocab_size=cfg.get("vocab_size"))
    given = a.encoder_seq_length or a.seq_length
    if given:
        fields.update(seq_length=given, encoder_seq_length=given, decoder_seq_length=a.decoder_seq_length or given,
                      max_position_embeddings=max(fields["max_position_embeddings"], given))
    return fields


def _checkpoint_fields(a: argparse.Namespace) -> dict:
    """A checkpoint's model from its megatron_args.json, as --use-checkpoint-args takes it (its architecture;
    values the resolution fills alike are left to it), with its vocabulary and dropout; its sequence lengths
    where the command line gives none."""
    with open(os.path.join(a.load, "megatron_args.json")) as f:
        saved = json.load(f)
    fields = {k: saved[k] for k in ARCHITECTURE if saved.get(k) not in (None, False) and saved[k] != GPT_DEFAULTS.get(k)}
    fields.update({k: saved[k] for k in ("model_type", "vocab_size", "make_vocab_size_divisible_by", "hidden_dropout",
                                         "attention_dropout") if saved.get(k) is not None})
    fields.update({k: saved[k] for k in SEQUENCE if getattr(a, k) is None and saved.get(k) is not None})
    return fields


def model_of(a: argparse.Namespace) -> ModelShape:
    """The model of the flags, of --load's checkpoint or of --hf-config's config.json, resolved as pretrain_*.py
    resolves its flags (`resolve_model`: the family's defaults and checks) into the spec's configuration."""
    fields = _hf_fields(a) if a.hf_config else _checkpoint_fields(a) if a.load else {}
    merged = {**vars(a), "model_type": a.model, **fields}
    for flag in ("num_layers", "hidden_size", "num_attention_heads"):
        if merged[flag] is None:
            raise UserError(f"--{flag.replace('_', '-')} is required (or --load CKPT, or --hf-config config.json)")
    spec = spec_for(merged["model_type"])
    merged["vocab_size"] = a.vocab_size or merged["vocab_size"] or spec.reference_vocab_size
    if not (merged["seq_length"] or merged["encoder_seq_length"]):
        merged["seq_length"] = DEFAULT_SEQ
    return ModelShape(spec, spec.config(resolve_model(argparse.Namespace(**merged))))


def cluster_of(a: argparse.Namespace) -> Cluster:
    mem, tflops, intra, inter = GPUS[a.gpu]
    return Cluster(a.nodes, a.gpus_per_node, a.gpu_memory_gb or mem, a.peak_tflops or tflops,
                   a.intra_node_gbps or intra, a.inter_node_gbps or inter, a.efficiency,
                   allocator_overhead=a.allocator_overhead, hop_latency_ms=a.hop_latency_ms,
                   instruction_ms=a.instruction_ms)


def main(argv=None) -> None:
    a = build_parser(_planner_args, prog="plan_layout.py").parse_args(argv)
    shape = model_of(a)
    if a.global_batch_size is None:
        raise UserError("--global-batch-size is required: the planner divides it into micro-batch x gas x dp")
    c = cluster_of(a)
    precision = "bf16" if a.bf16 else "fp16" if a.fp16 else "fp32"
    cands = rank_layouts(shape, c, a.global_batch_size, precision,
                         sequence_parallel_available=not a.no_sequence_parallel, ep=a.expert_model_parallel_size or 1)
    if a.json:
        json.dump(dict(model=shape.record(), cluster=vars(c), candidates=as_json(cands)), sys.stdout, indent=1,
                  default=str)
        print()
        return
    fitting = sum(x.fits for x in cands)
    print(f"{shape.spec.model_type} {shape.transformer_layers} layers, hidden {shape.hidden}, seq "
          f"{shape.seq}; {c.nodes} x {c.gpus_per_node} GPUs of {c.memory_gb:g} GB ({c.peak_tflops:g} TFLOP/s, "
          f"efficiency {c.efficiency:g}, allocator overhead {c.allocator_overhead:.0%}); global batch "
          f"{a.global_batch_size}, {precision}; {fitting} of {len(cands)} layouts fit (predictions; memory per "
          f"rank on the worst stage, step time in seconds)")
    print(table(cands[:a.top]))


if __name__ == "__main__":
    exit_on_user_error(main)
