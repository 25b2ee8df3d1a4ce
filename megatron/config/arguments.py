"""Megatron-compatible command line: the parser only.

`parse_args()` parses, merges the DeepSpeed JSON config and derives and validates every value in one place,
`megatron.config.resolution.resolve_args` (global batch = micro x gas x dp, kv channels, warm-up, ...).
Options that the DeepSpeed config can also set (batch sizes, ZeRO stage, precision, clipping, loss scale)
default to None here, so that "not given" can be told apart from "given": see `megatron.config.ds_config`.
Old Megatron / CPM-Pretrain spellings are accepted as aliases (--model-parallel-size, --batch-size,
--kv-hidden-size, --ff-hidden-size, --enc-seq-length, --dec-seq-length, --warmup).

This module and the resolution import neither torch nor DeepSpeed (DeepSpeed's --deepspeed /
--deepspeed_config flags are declared here as `deepspeed.add_config_arguments` does), so that
`python -m megatron.config.preflight` checks a command line in one process in about a second. A mistake, an
unknown flag included, is a one-line `megatron.errors.UserError`.
"""
from __future__ import annotations

import argparse
from typing import Callable, Dict, Optional, Sequence

from megatron.config.moe_args import add_moe_args
from megatron.config.resolution import PIPELINE_SCHEDULES, resolve_args
from megatron.errors import ArgumentParser
from megatron.tokenizer import TOKENIZER_TYPES

ExtraArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]

# What each entry point fills in for options left unset (pretrain_gpt2.py, pretrain_t5.py).
ENTRY_DEFAULTS: Dict[str, Dict[str, object]] = {
    "gpt": dict(model_type="gpt", tokenizer_type="GPT2BPETokenizer", layernorm_epsilon=1e-5),
    "t5": dict(model_type="t5", tokenizer_type="SentencePieceTokenizer", vocab_extra_ids=100,
               layernorm_epsilon=1e-6),
}


def _model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, default=None,
                   help="transformer layers (T5: the encoder, and the decoder unless --decoder-num-layers)")
    g.add_argument("--hidden-size", type=int, default=None)
    g.add_argument("--ffn-hidden-size", "--ff-hidden-size", type=int, default=None, help="default 4 * hidden")
    g.add_argument("--num-attention-heads", type=int, default=None)
    g.add_argument("--kv-channels", "--kv-hidden-size", type=int, default=None, help="default hidden / heads")
    g.add_argument("--seq-length", type=int, default=None, help="GPT sequence length")
    g.add_argument("--encoder-seq-length", "--enc-seq-length", type=int, default=None, help="T5, default seq-length")
    g.add_argument("--decoder-seq-length", "--dec-seq-length", type=int, default=None, help="T5, default seq-length")
    g.add_argument("--max-position-embeddings", type=int, default=None, help="default: the longest sequence")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128,
                   help="pad the vocabulary to a multiple of this times the tensor-parallel size")
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--layernorm-epsilon", "--norm-epsilon", dest="layernorm_epsilon", type=float, default=None,
                   help="epsilon of every LayerNorm / RMSNorm: GPT 1e-5, T5 1e-6")
    g.add_argument("--recompute-granularity", choices=["full", "selective"], default=None,
                   help="recompute activations in backward. full: whole transformer layers keep only their input "
                        "(see --recompute-method); selective: only the attention core (softmax(QK^T) V with its "
                        "dropout), whose stored scores grow with s^2 (the 5as/h term of Korthikanti et al.). "
                        "scaled_dot_product_attention stores those only in its math kernel (CPU with "
                        "--attention-dropout > 0); its fused kernels (flash / memory-efficient on GPUs, the CPU "
                        "flash kernel without dropout) store none, and selective is then a no-op (on GPUs it does not "
                        "checkpoint the core at all)")
    g.add_argument("--recompute-method", choices=["uniform", "block"], default=None,
                   help="with --recompute-granularity full: uniform (default) recomputes every run of "
                        "--recompute-num-layers layers; block recomputes the first --recompute-num-layers layers of "
                        "each pipeline stage (each model chunk) and keeps the others")
    g.add_argument("--recompute-num-layers", type=int, default=None,
                   help="layers per recomputed run (uniform) or recomputed layers per stage (block); default 1")
    g.add_argument("--checkpoint-activations", action="store_true",
                   help="alias of --recompute-granularity full --recompute-method uniform")
    g.add_argument("--checkpoint-num-layers", type=int, default=None, help="alias of --recompute-num-layers")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None,
                   help="a separate output layer instead of the word embeddings (GPT: Llama-family models; T5: v1.1, "
                        "without the d_model^-0.5 output scaling, Hugging Face's tie_word_embeddings=False)")
    g = p.add_argument_group("GPT layer (GPT-2 defaults; the Llama-family layer: --position-embedding-type rope "
                             "--normalization RMSNorm --swiglu --disable-bias-linear --untie-embeddings-and-output-"
                             "weights [--group-query-attention --num-query-groups G])")
    g.add_argument("--position-embedding-type", choices=["learned_absolute", "rope", "none"], default=None,
                   help="learned_absolute (GPT-2's table, default), rope (rotary, applied to queries and keys in every "
                        "layer) or none")
    g.add_argument("--rotary-base", type=float, default=None, help="rope: the base of the frequencies, default 10000")
    g.add_argument("--rotary-percent", type=float, default=None,
                   help="rope: the fraction of each head's channels that rotate, default 1.0")
    g.add_argument("--use-rope-scaling", action="store_true", default=None,
                   help="rope: Llama 3.1's frequency scaling (Hugging Face rope_type 'llama3')")
    g.add_argument("--rope-scaling-factor", type=float, default=None, help="llama3 scaling factor, default 8")
    g.add_argument("--rope-scaling-low-freq-factor", type=float, default=None, help="default 1")
    g.add_argument("--rope-scaling-high-freq-factor", type=float, default=None, help="default 4")
    g.add_argument("--rope-scaling-original-max-position-embeddings", type=int, default=None,
                   help="the context length the frequencies were trained at, default 8192")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default=None, help="default LayerNorm")
    g.add_argument("--swiglu", action="store_true", default=None,
                   help="MLP silu(x W_gate) * (x W_up) W_down; --ffn-hidden-size defaults to 2/3 of 4h rounded down to "
                        "a multiple of 64 (Megatron's rule)")
    g.add_argument("--group-query-attention", action="store_true", default=None,
                   help="grouped-query attention: --num-query-groups key/value heads, each shared by heads / groups "
                        "query heads")
    g.add_argument("--num-query-groups", type=int, default=None,
                   help="with --group-query-attention, default 1 (multi-query attention)")
    g.add_argument("--disable-bias-linear", action="store_true", default=None, help="no bias in any linear layer")
    g.add_argument("--gelu", choices=["tanh", "erf"], default="tanh",
                   help="the MLP's GELU (without --swiglu): tanh (GPT-2's approximation, default; Megatron-LM's "
                        "--openai-gelu and its fused bias-GELU) or erf (exact; Megatron-LM's F.gelu)")
    g.add_argument("--add-qkv-bias", action="store_true", default=None,
                   help="a bias in the QKV projection even with --disable-bias-linear (Qwen2)")
    g.add_argument("--qk-layernorm", action="store_true", default=None,
                   help="normalise each query and key head over its --kv-channels after the projection and before "
                        "rotary positions, with a norm of --normalization's kind whose weight (kv_channels) all heads "
                        "share (Megatron-LM's --qk-layernorm; Qwen3's q_norm / k_norm)")
    g.add_argument("--qk-layernorm-full", action="store_true", default=None,
                   help="instead of --qk-layernorm: an RMSNorm over each token's whole query projection (heads x "
                        "kv_channels, a weight per channel) and one over its whole key projection (query groups x "
                        "kv_channels), before rotary positions (OLMo-2's q_norm / k_norm); needs --normalization "
                        "RMSNorm. Under tensor parallelism its weights split with the heads and each norm all-reduces "
                        "a (b, s) sum of squares")
    g.add_argument("--post-sublayer-norm", action="store_true", default=None,
                   help="the layer's two norms on the attention and MLP outputs, before the dropout and the residual "
                        "add, instead of on their inputs: x + drop(N(attn(x))), then the same with the MLP (OLMo-2's "
                        "reordered norm; not Megatron-LM's --apply-residual-connection-post-layernorm); the final norm "
                        "stays")
    g = p.add_argument_group("T5 (v1.0 defaults; T5 v1.1: --feed-forward-proj gated-gelu "
                             "--untie-embeddings-and-output-weights)")
    g.add_argument("--decoder-num-layers", type=int, default=None, help="decoder depth, default --num-layers")
    g.add_argument("--feed-forward-proj", choices=["relu", "gated-gelu"], default=None,
                   help="T5 feed-forward (Hugging Face's feed_forward_proj): relu (v1.0, default) or gated-gelu "
                        "(v1.1: GELU-tanh(x Wi0) * (x Wi1))")
    g.add_argument("--relative-attention-num-buckets", type=int, default=None, help="T5 position buckets, default 32")
    g.add_argument("--relative-attention-max-distance", type=int, default=None,
                   help="T5 distance of the last bucket, default 128")


def _parallel_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", "--model-parallel-size", dest="tensor_model_parallel_size",
                   type=int, default=1)
    g.add_argument("--pipe-parallel-size", "--pipeline-model-parallel-size", dest="pipe_parallel_size",
                   type=int, default=1, help="pipeline stages; 0 and 1 both mean no pipeline")
    g.add_argument("--sequence-parallel", action="store_true",
                   help="with tensor parallelism, split the LayerNorm, dropout and residual regions along the sequence "
                        "(Korthikanti et al. 2022): activation memory outside attention / MLP drops by the tp size "
                        "at the same communication volume (all-gather + reduce-scatter instead of all-reduce); the "
                        "sequence length must divide by tp. No effect at tp = 1")
    g.add_argument("--zero-stage", type=int, default=None,
                   help="ZeRO stage 0 or 1 (the JSON config's zero_optimization.stage, where given, must agree)")
    g.add_argument("--partition-method", type=str, default=None,
                   help="how the Pipe model splits its layers: type:REGEX (default type:TransformerLayer), parameters, "
                        "uniform, or explicit layer boundaries such as 0,5,11 (pp + 1 numbers; pp x v + 1 with "
                        "--virtual-pipe-stages v)")
    g.add_argument("--pipeline-schedule", type=str.lower, choices=PIPELINE_SCHEDULES,
                   default=None, help="pipeline schedule (pipeline.schedule in the DeepSpeed JSON): 1f1b (default), "
                                      "gpipe, interleaved (default with --virtual-pipe-stages > 1), zb-h1 "
                                      "(zero bubble)")
    g.add_argument("--virtual-pipe-stages", type=int, default=None,
                   help="model chunks per pipeline stage for the interleaved schedule (pipeline.virtual_stages)")
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                   help="Megatron's way to give --virtual-pipe-stages: transformer layers per chunk, "
                        "v = layers / (pp x this)")
    g.add_argument("--local_rank", "--local-rank", type=int, default=None,
                   help="set by the deepspeed launcher; LOCAL_RANK in the environment is what is used")


def _batch_and_optim_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch")
    g.add_argument("--micro-batch-size", "--batch-size", dest="micro_batch_size", type=int, default=None)
    g.add_argument("--global-batch-size", type=int, default=None, help="micro x gas x dp")
    g.add_argument("--gas", "--gradient-accumulation-steps", dest="gas", type=int, default=None)
    g.add_argument("--rampup-batch-size", nargs=3, type=int, default=None, metavar=("START", "INCREMENT", "SAMPLES"),
                   help="grow the global batch from START by INCREMENT over SAMPLES training samples, up to "
                        "--global-batch-size (Megatron's ramp-up; needs --train-samples)")
    g = p.add_argument_group("optimisation")
    g.add_argument("--lr", type=float, default=1e-4)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["linear", "cosine", "constant", "inverse-square-root"],
                   default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=None)
    g.add_argument("--lr-warmup-fraction", "--warmup", dest="lr_warmup_fraction", type=float, default=None,
                   help="warm-up as a fraction of the decay iterations (or samples)")
    g.add_argument("--lr-decay-iters", type=int, default=None, help="default train-iters")
    g.add_argument("--lr-warmup-samples", type=int, default=None, help="warm-up in samples (with --train-samples)")
    g.add_argument("--lr-decay-samples", type=int, default=None,
                   help="decay over this many samples (with --train-samples; default train-samples)")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--clip-grad", type=float, default=None, help="gradient norm clip, 0 = off (default 1.0)")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g = p.add_argument_group("precision")
    g.add_argument("--fp16", action="store_true", default=None)
    g.add_argument("--bf16", action="store_true", default=None)
    g.add_argument("--loss-scale", type=float, default=None, help="static loss scale; default dynamic")
    g.add_argument("--initial-loss-scale", type=float, default=None, help="power of two, default 2**32")
    g.add_argument("--min-loss-scale", type=float, default=None, help="default 1")
    g.add_argument("--loss-scale-window", type=int, default=None, help="default 1000")
    g.add_argument("--hysteresis", type=int, default=None, help="default 2")


def _data_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None, help="PREFIX, or WEIGHT PREFIX WEIGHT PREFIX ...")
    g.add_argument("--split", type=str, default="969,30,1", help="train,valid,test proportions")
    g.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES, default=None,
                   help="default: GPT2BPETokenizer for GPT-2, SentencePieceTokenizer for T5")
    g.add_argument("--vocab-file", type=str, default=None)
    g.add_argument("--merge-file", type=str, default=None)
    g.add_argument("--tokenizer-model", type=str, default=None,
                   help="SentencePiece model; HuggingFaceTokenizer: tokenizer.json or the folder holding it")
    g.add_argument("--vocab-extra-ids", type=int, default=0, help="T5 sentinel tokens")
    g.add_argument("--reset-position-ids", action="store_true")
    g.add_argument("--reset-attention-mask", action="store_true")
    g.add_argument("--eod-mask-loss", action="store_true")
    g.add_argument("--mask-prob", type=float, default=0.15, help="T5 span-corruption probability")
    g.add_argument("--num-workers", type=int, default=2, help="data loader worker processes")


def _run_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("training run")
    g.add_argument("--train-iters", type=int, default=None, help="iterations to train (or give --train-samples)")
    g.add_argument("--train-samples", type=int, default=None,
                   help="samples to train; the iterations follow from the (ramped) global batch")
    g.add_argument("--distributed-timeout-minutes", type=float, default=None,
                   help="how long a rank waits for its peers (pipeline sends/receives, every collective) before "
                        "failing with an error naming the stage, group and operation; default 10. Also "
                        "pipeline.timeout_s (seconds) in the DeepSpeed JSON; env TDS_TIMEOUT_S overrides both")
    g.add_argument("--exit-interval", type=int, default=None,
                   help="stop (after saving, with --save) when the iteration is a multiple of this")
    g.add_argument("--eval-interval", type=int, default=1000)
    g.add_argument("--eval-iters", type=int, default=100, help="0 = no evaluation")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", type=str, default=None)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--deepspeed-verbose", action="store_true",
                   help="keep DeepSpeed's start-up prints (topology, layer listing, INFO log) in the log")
    g.add_argument("--pipeline-timeline", type=str, default=None, metavar="OUT.json",
                   help="record when each pipeline stage ran each instruction (Chrome trace; pipeline.timeline); "
                        "draw it with tools/plot_pipeline.py OUT.json -o timeline.png")
    g.add_argument("--pipeline-timeline-batches", type=int, nargs="+", default=None, metavar="ITERATION",
                   help="iterations to record (pipeline.timeline_batches), default 3 4")
    g = p.add_argument_group("memory (megatron/planning, tools/plan_layout.py)")
    g.add_argument("--dry-run", action="store_true",
                   help="print the planner's prediction for this layout (peak memory per rank by part, per stage; "
                        "step time) without building the model, and exit; a layout that cannot fit in "
                        "--gpu-memory-gb is refused in one line naming the part that overflows")
    g.add_argument("--gpu-memory-gb", type=float, default=None,
                   help="memory per GPU for --dry-run and the start-up prediction (default 80); given, --dry-run "
                        "plans for GPUs (fused attention) also on a machine without one")
    g.add_argument("--log-memory", action="store_true",
                   help="measure iteration 2's peak memory per rank (tensor storages live at its start + the "
                        "allocator's rise during it, megatron/training/memory_log.py) and print one line per rank "
                        "beside the planner's prediction")
    g = p.add_argument_group("speed")
    g.add_argument("--cross-entropy-loss-fusion", action="store_true",
                   help="the vocab-parallel cross entropy without whole-size fp32 copies of the logits: saves the "
                        "logits in their own dtype (bf16: 2 bytes per logit instead of the fp32 softmax's 4) and "
                        "works in fp32 over row chunks; the same loss and gradient (megatron/mpu/cross_entropy.py)")
    g.add_argument("--compile", action="store_true",
                   help="torch.compile each transformer layer (not the pipeline engine); a layer that cannot run "
                        "compiled (ZB-H1's deferred weight gradients) runs eagerly, and one line says so")
    g = p.add_argument_group("long runs (preemption, time limits, NaN)")
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on SIGTERM or SIGUSR1 (SLURM's preemption and time-limit signals, `scancel --signal`) to any "
                        "rank, every rank finishes its iteration, saves a checkpoint at it (with --save) and exits 0; "
                        "further signals during that save are ignored (on in the example scripts)")
    g.add_argument("--exit-duration-in-mins", type=float, default=None,
                   help="save (with --save) and exit 0 once the run has lasted this many minutes")
    g.add_argument("--check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                   action=argparse.BooleanOptionalAction, default=True,
                   help="fp32/bf16: stop before the optimizer step when a loss, an activation sent between stages "
                        "or a gradient is NaN or infinite, naming the iteration, the stage and rank where it first "
                        "appeared and the last checkpoint (default on; fp16 skips such steps through its loss scale "
                        "instead)")
    g.add_argument("--max-skipped-steps", type=int, default=100, metavar="N",
                   help="fp16: stop after N consecutive steps skipped for overflow (0 = never; default 100)")
    g.add_argument("--check-replicas-interval", type=int, default=None, metavar="N",
                   help="every N iterations, compare the bits the data-parallel replicas hold alike (the parameters; "
                        "at ZeRO stage 0 also the optimizer state) and stop with one line naming the ranks, the "
                        "tensor and the iteration where they differ (silent corruption), exit 2; off by default")
    g.add_argument("--layout-invariant", action="store_true",
                   help="sum gradients, the loss and the gradient norm in one fixed order over the global batch's "
                        "micro-batches, so that every split into data-parallel replicas (a power of two), "
                        "gradient-accumulation steps and pipeline stages gives the same bits (fp32, ZeRO stage 0 or 1, "
                        "not ZB-H1; docs/training.md); attention dropout then takes the explicit attention path on "
                        "GPUs too")
    g.add_argument("--keyed-dropout", action="store_true",
                   help="every dropout mask a pure function of (seed, iteration, global sample, layer, site, position, "
                        "feature), computed by Philox4x32-10 for this rank's part only: no micro-batch size, tensor or "
                        "sequence split changes a mask, and no rank draws numbers for another's part; slower than the "
                        "default rule, which keys a mask by (iteration, micro-batch) (docs/training.md)")
    g.add_argument("--check-replicas-at-save", action="store_true",
                   help="check the replicas before every save, so that a checkpoint is written, and `latest` moved "
                        "to it, only after a passing check")
    g = p.add_argument_group("checkpoints")
    g.add_argument("--save", type=str, default=None)
    g.add_argument("--load", type=str, default=None)
    g.add_argument("--ckpt-step", type=int, default=None, metavar="N",
                   help="load iteration N of --load (its folder iter_000000N) instead of the one `latest` names")
    g.add_argument("--save-interval", type=int, default=None)
    g.add_argument("--async-save", action="store_true",
                   help="write checkpoints in the background: the state is copied off the training tensors, "
                        "training goes on, `latest` moves only once every rank's files are complete; a new save "
                        "and the run's exit wait for the previous one")
    g.add_argument("--no-load-optim", action="store_true", help="load model weights only")
    g.add_argument("--no-load-rng", action="store_true", help="do not restore the random number generators")
    g.add_argument("--pretrained-checkpoint", type=str, default=None, metavar="DIR",
                   help="start from the model weights of the checkpoint in DIR (any tp/pp; e.g. an import-hf output) "
                        "when --load holds no checkpoint yet: iteration 0, fresh optimizer; once --load has one "
                        "(restarts, resumed runs) that is loaded instead")
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model's architecture (layers, widths, heads, positions, norms, MLP, tied or untied "
                        "head, ...) from the checkpoint of --load, or of --pretrained-checkpoint while --load holds "
                        "none; a model flag also given must agree with it (Megatron-LM's option)")
    g.add_argument("--finetune", action="store_true",
                   help="load only the model weights from --load (any tp/pp/dp): iteration 0, fresh optimizer and "
                        "LR schedule, 0 consumed samples")
    g.add_argument("--trust-checkpoint", action="store_true",
                   help="read the checkpoint's pickles with torch.load(weights_only=False): only for a file from a "
                        "source you trust (a pickle can run any code). By default every checkpoint file is read "
                        "with weights_only=True and an allowlist, and a file that needs anything else is refused")


def _deepspeed_args(p: argparse.ArgumentParser) -> None:
    """The flags of `deepspeed.add_config_arguments`, without importing DeepSpeed."""
    g = p.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    g.add_argument("--deepspeed", action="store_true", help="enable DeepSpeed (accepted; always on)")
    g.add_argument("--deepspeed_config", "--deepspeed-config", dest="deepspeed_config", type=str, default=None,
                   help="DeepSpeed JSON configuration file")
    g.add_argument("--deepscale", action="store_true", help="deprecated alias of --deepspeed")
    g.add_argument("--deepscale_config", type=str, default=None, help="deprecated alias of --deepspeed_config")


def build_parser(extra_args_provider: Optional[ExtraArgsProvider] = None, prog: Optional[str] = None
                 ) -> argparse.ArgumentParser:
    p = ArgumentParser(prog=prog, description="Megatron-TDS pretraining", allow_abbrev=False)
    for add in (_model_args, add_moe_args, _parallel_args, _batch_and_optim_args, _data_args, _run_args,
                _deepspeed_args):
        add(p)
    if extra_args_provider is not None:
        p = extra_args_provider(p)
    return p


def parse_args(argv: Optional[Sequence[str]] = None, extra_args_provider: Optional[ExtraArgsProvider] = None,
               defaults: Optional[Dict[str, object]] = None, world_size: Optional[int] = None,
               prog: Optional[str] = None) -> argparse.Namespace:
    """Parse `argv` (default sys.argv), fill entry-point `defaults` for options left unset, resolve and validate.

    `world_size` defaults to the launcher's WORLD_SIZE (1 without a launcher). The result carries the derived
    values (`data_parallel_size`, `gas`, `global_batch_size`, `lr_warmup_iters`, ...) and `ds_config`, the
    dict DeepSpeed receives. Any mistake raises a one-line `UserError`.
    """
    args = build_parser(extra_args_provider, prog).parse_args(argv)
    args.deepspeed_config = args.deepspeed_config or args.deepscale_config
    if args.use_checkpoint_args:
        from megatron.config.checkpoint_args import apply_checkpoint_args, given_options
        given = given_options(build_parser(extra_args_provider, prog), argv)
        apply_checkpoint_args(args, given, (defaults or {}).get("model_type"))
    for key, value in (defaults or {}).items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return resolve_args(args, world_size)
