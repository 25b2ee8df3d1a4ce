#!/usr/bin/env bash
# Pretrain a Llama-style mixture of experts (ds_pretrain_llama.sh's layer, its MLP replaced by routed SwiGLU
# experts: 8 experts, top-2, softmax over the top-k logits as in Mixtral, the aux and z losses) with tensor x
# pipeline x expert x data parallelism.
#
#   bash examples/ds_pretrain_moe.sh [extra pretrain_gpt2.py arguments]
#
# Every setting below is a variable that the environment overrides, as in ds_pretrain_llama.sh, e.g.
#   TRAIN_ITERS=200 bash examples/ds_pretrain_moe.sh             a longer run
#   TP=2 PP=2 EP=2 bash examples/ds_pretrain_moe.sh               another layout (tp > 1 adds --sequence-parallel)
#   SHARED_FFN=128 bash examples/ds_pretrain_moe.sh               and a shared expert of that width
#   bash examples/ds_pretrain_moe.sh --moe-router-pre-softmax     Qwen-MoE's routing (softmax, then top-k)
#   PRETRAINED=runs/imported TOKENIZER_MODEL=... DATA_PATH=... bash examples/ds_pretrain_moe.sh
#                                                                 continue an imported Mixtral or Qwen-MoE (import-hf,
#                                                                 as in ds_pretrain_llama.sh: the model comes from it)
# The MoE flags are Megatron-LM's (docs/training.md, "Mixture of experts"); the experts of a layer are spread over
# EP ranks folded out of each pipeline stage's tp x dp ranks. At EP > 1 the run is fp32 with ZeRO stage 0 for now
# (megatron/config/moe_args.py), so with GPUs EP defaults to 1 (bf16 and ZeRO-1); EP=2 there trains in fp32.
# Relative paths mean what they mean where the script is started (it never changes directory); its outputs go to
# WORK_DIR, runs/moe under that folder by default.
#
# Without DATA_PATH the embedded default corpus is used (the docstrings of Python's standard library), with a
# byte-level BPE tokenizer.json trained on it (tools/train_tokenizer.py --type hf-bpe, read as
# --tokenizer-type HuggingFaceTokenizer) and its .bin/.idx, all built once under WORK_DIR.
# Without GPUs: a tiny model (4 layers of 8 experts, 2 key/value groups of 2 heads) on 8 CPU processes (tp=1, pp=2,
# ep=2, dp=4, gloo), fp32, 20 iterations, about a minute on 2 cores. With GPUs: every GPU of this node, 16 layers of
# hidden 2048 (32 heads in 8 groups, rope base 500000), each with 8 experts of ffn 2048 (~1.9B parameters, ~0.7B of
# them active per token), EP=1 in bf16 (fp16 before compute capability 8.0) with ZeRO-1 and selective recomputation.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
# shellcheck source=examples/common.sh
source "$REPO/examples/common.sh"
NGPUS=${NGPUS:-$(count_gpus)}
WORK_DIR=${WORK_DIR:-$PWD/runs/moe}
checkpoint_model "$@"

if (( NGPUS == 0 )); then
    TP=${TP:-1}  # 4 data-parallel ranks per stage to spread the experts over: as fast as tp=2 at twice the batch
fi
parallel_defaults
EP=${EP:-$(( NGPUS > 0 ? 1 : 2 ))}
NUM_EXPERTS=${NUM_EXPERTS:-8}; TOPK=${TOPK:-2}; SHARED_FFN=${SHARED_FFN:-}
AUX_LOSS_COEFF=${AUX_LOSS_COEFF:-1e-2}; Z_LOSS_COEFF=${Z_LOSS_COEFF:-1e-3}
if (( EP > 1 )); then
    ZERO_STAGE=${ZERO_STAGE:-0}  # expert parallelism runs neither ZeRO-1 nor bf16 / fp16 yet
    if (( NGPUS > 0 )) && [[ -z ${PRECISION+set} ]]; then
        echo "EP=$EP: fp32 and ZeRO stage 0 (expert parallelism runs neither bf16 / fp16 nor ZeRO-1 yet; EP=1 does)"
    fi
    PRECISION=${PRECISION-}
fi
if (( NGPUS > 0 )); then
    NUM_LAYERS=${NUM_LAYERS:-16}; HIDDEN=${HIDDEN:-2048}; HEADS=${HEADS:-32}; QUERY_GROUPS=${QUERY_GROUPS:-8}
    FFN=${FFN:-8192}; MOE_FFN=${MOE_FFN:-2048}; SEQ_LEN=${SEQ_LEN:-2048}; ROTARY_BASE=${ROTARY_BASE:-500000}
    MICRO_BATCH=${MICRO_BATCH:-4}; GAS=${GAS:-16}; TRAIN_ITERS=${TRAIN_ITERS:-20000}
    LR=${LR:-3e-4}; MIN_LR=${MIN_LR:-3e-5}; VOCAB_SIZE=${VOCAB_SIZE:-32000}
    PRECISION=${PRECISION-$(gpu_precision)}
    ACTIVATION_CHECKPOINT=${ACTIVATION_CHECKPOINT---recompute-granularity=selective}
    LOG_INTERVAL=${LOG_INTERVAL:-10}; EVAL_INTERVAL=${EVAL_INTERVAL:-1000}; EVAL_ITERS=${EVAL_ITERS:-10}
    SAVE_INTERVAL=${SAVE_INTERVAL:-1000}; NUM_WORKERS=${NUM_WORKERS:-2}
else
    NUM_LAYERS=${NUM_LAYERS:-4}; HIDDEN=${HIDDEN:-64}; HEADS=${HEADS:-4}; QUERY_GROUPS=${QUERY_GROUPS:-2}
    FFN=${FFN:-192}; MOE_FFN=${MOE_FFN:-128}; SEQ_LEN=${SEQ_LEN:-64}; ROTARY_BASE=${ROTARY_BASE:-10000}
    MICRO_BATCH=${MICRO_BATCH:-4}; GAS=${GAS:-2}; TRAIN_ITERS=${TRAIN_ITERS:-20}
    LR=${LR:-2e-3}; MIN_LR=${MIN_LR:-2e-4}; VOCAB_SIZE=${VOCAB_SIZE:-2048}
    PRECISION=${PRECISION:-}; ACTIVATION_CHECKPOINT=${ACTIVATION_CHECKPOINT:-}
    LOG_INTERVAL=${LOG_INTERVAL:-1}; EVAL_INTERVAL=${EVAL_INTERVAL:-100}; EVAL_ITERS=${EVAL_ITERS:-2}
    SAVE_INTERVAL=${SAVE_INTERVAL:-100}; NUM_WORKERS=${NUM_WORKERS:-0}
fi
run_settings
DS_CONFIG=${DS_CONFIG:-$REPO/examples/ds_config_moe.json}

DEFAULT_DATA=
if [[ -z "${DATA_PATH:-}" ]]; then
    DEFAULT_DATA=$WORK_DIR/data
    DATA_PATH=$DEFAULT_DATA/stdlib_docs_text_document
    TOKENIZER_MODEL=$DEFAULT_DATA/tokenizer
fi
: "${TOKENIZER_MODEL:?give TOKENIZER_MODEL (a tokenizer.json or its folder) with DATA_PATH}"

common_train_args
TRAIN_ARGS+=(--seq-length "$SEQ_LEN" --hidden-dropout 0 --attention-dropout 0
             --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL"
             --expert-model-parallel-size "$EP" --moe-aux-loss-coeff "$AUX_LOSS_COEFF"
             --moe-z-loss-coeff "$Z_LOSS_COEFF")
model_args FFN --ffn-hidden-size ROTARY_BASE --rotary-base QUERY_GROUPS --num-query-groups \
    NUM_EXPERTS --num-experts MOE_FFN --moe-ffn-hidden-size TOPK --moe-router-topk
if [[ -n $SHARED_FFN ]]; then TRAIN_ARGS+=(--moe-shared-expert-intermediate-size "$SHARED_FFN"); fi
if (( TP > 1 )); then TRAIN_ARGS+=(--sequence-parallel); fi  # each tensor-parallel rank routes its part
if [[ $FROM_CHECKPOINT == 0 ]]; then  # the Llama-style layer; a checkpoint gives its own
    TRAIN_ARGS+=(--max-position-embeddings "$SEQ_LEN" --position-embedding-type rope --normalization RMSNorm --swiglu
                 --group-query-attention --disable-bias-linear --untie-embeddings-and-output-weights)
fi

if [[ -n "$DEFAULT_DATA" ]]; then
    preflight gpt --args-only "${TRAIN_ARGS[@]}" "$@"
    build_default_data "$DEFAULT_DATA" hf-bpe "$VOCAB_SIZE"
fi
preflight gpt "${TRAIN_ARGS[@]}" "$@"
echo "Llama-style mixture of experts: tp=$TP, pp=$PP, ep=$EP, dp=$(( $(world_size) / (TP * PP) )), $NUM_EXPERTS" \
     "experts, top-$TOPK, $TRAIN_ITERS iterations, checkpoints in $SAVE"
launch pretrain_gpt2.py "${TRAIN_ARGS[@]}" "$@"
samples
