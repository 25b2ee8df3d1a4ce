#!/usr/bin/env bash
# Pretrain a Llama-style GPT (rotary positions, RMSNorm, SwiGLU, grouped-query attention, no biases, untied head)
# with tensor x pipeline x data parallelism, or continue pretraining an imported Llama / Mistral / Qwen2.
#
#   bash examples/ds_pretrain_llama.sh [extra pretrain_gpt2.py arguments]
#
# Every setting below is a variable that the environment overrides, as in ds_pretrain_gpt2.sh, e.g.
#   TRAIN_ITERS=20 bash examples/ds_pretrain_llama.sh                      a short run
#   DATA_PATH=data/my_text_document TOKENIZER_MODEL=path/to/tokenizer_dir bash ...   your data and tokenizer.json
# Continued pretraining from a Hugging Face folder (docs/checkpoints.md, "Continued pretraining"):
#   python tools/convert_checkpoint.py import-hf --input HF_DIR --save runs/imported \
#       --tensor-model-parallel-size 2 --pipe-parallel-size 2
#   PRETRAINED=runs/imported TOKENIZER_MODEL=runs/imported/iter_0000000/tokenizer DATA_PATH=... \
#       bash examples/ds_pretrain_llama.sh
# PRETRAINED is --pretrained-checkpoint: its weights start the run while SAVE holds no checkpoint; restarts and
# re-runs resume from SAVE. The model (Llama, Mistral, Qwen2; tied or untied head) comes from it
# (--use-checkpoint-args): the script passes none of its own model defaults, only the variables set here.
# Relative paths mean what they mean where the script is started (it never changes directory); its outputs go to
# WORK_DIR, runs/llama under that folder by default.
#
# Without DATA_PATH the embedded default corpus is used (the docstrings of Python's standard library), with a
# byte-level BPE tokenizer.json trained on it (tools/train_tokenizer.py --type hf-bpe, read as
# --tokenizer-type HuggingFaceTokenizer) and its .bin/.idx, all built once under WORK_DIR.
# Without GPUs: a tiny Llama-style model (2 key/value groups of 2 heads) on 8 CPU processes (tp=2, pp=2, dp=2,
# gloo), 200 iterations, a few minutes on 2 cores. With GPUs: every GPU of this node, a ~1B Llama-style model
# (16 layers, hidden 2048, 32 heads in 8 groups, ffn 8192, rope base 500000) in bf16 (fp16 before compute
# capability 8.0) with selective recomputation.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
# shellcheck source=examples/common.sh
source "$REPO/examples/common.sh"
NGPUS=${NGPUS:-$(count_gpus)}
WORK_DIR=${WORK_DIR:-$PWD/runs/llama}
checkpoint_model "$@"

parallel_defaults
if (( NGPUS > 0 )); then
    NUM_LAYERS=${NUM_LAYERS:-16}; HIDDEN=${HIDDEN:-2048}; HEADS=${HEADS:-32}; QUERY_GROUPS=${QUERY_GROUPS:-8}
    FFN=${FFN:-8192}; SEQ_LEN=${SEQ_LEN:-2048}; ROTARY_BASE=${ROTARY_BASE:-500000}
    MICRO_BATCH=${MICRO_BATCH:-4}; GAS=${GAS:-16}; TRAIN_ITERS=${TRAIN_ITERS:-20000}
    LR=${LR:-3e-4}; MIN_LR=${MIN_LR:-3e-5}; VOCAB_SIZE=${VOCAB_SIZE:-32000}
    PRECISION=${PRECISION-$(gpu_precision)}; ACTIVATION_CHECKPOINT=${ACTIVATION_CHECKPOINT---recompute-granularity=selective}
    LOG_INTERVAL=${LOG_INTERVAL:-10}; EVAL_INTERVAL=${EVAL_INTERVAL:-1000}; EVAL_ITERS=${EVAL_ITERS:-10}
    SAVE_INTERVAL=${SAVE_INTERVAL:-1000}; NUM_WORKERS=${NUM_WORKERS:-2}
else
    NUM_LAYERS=${NUM_LAYERS:-4}; HIDDEN=${HIDDEN:-64}; HEADS=${HEADS:-4}; QUERY_GROUPS=${QUERY_GROUPS:-2}
    FFN=${FFN:-192}; SEQ_LEN=${SEQ_LEN:-64}; ROTARY_BASE=${ROTARY_BASE:-10000}
    MICRO_BATCH=${MICRO_BATCH:-4}; GAS=${GAS:-2}; TRAIN_ITERS=${TRAIN_ITERS:-200}
    LR=${LR:-2e-3}; MIN_LR=${MIN_LR:-2e-4}; VOCAB_SIZE=${VOCAB_SIZE:-2048}
    PRECISION=${PRECISION:-}; ACTIVATION_CHECKPOINT=${ACTIVATION_CHECKPOINT:-}
    LOG_INTERVAL=${LOG_INTERVAL:-10}; EVAL_INTERVAL=${EVAL_INTERVAL:-100}; EVAL_ITERS=${EVAL_ITERS:-2}
    SAVE_INTERVAL=${SAVE_INTERVAL:-100}; NUM_WORKERS=${NUM_WORKERS:-0}
fi
run_settings
DS_CONFIG=${DS_CONFIG:-$REPO/examples/ds_config_gpt2.json}

DEFAULT_DATA=
if [[ -z "${DATA_PATH:-}" ]]; then
    DEFAULT_DATA=$WORK_DIR/data
    DATA_PATH=$DEFAULT_DATA/stdlib_docs_text_document
    TOKENIZER_MODEL=$DEFAULT_DATA/tokenizer
fi
: "${TOKENIZER_MODEL:?give TOKENIZER_MODEL (a tokenizer.json or its folder) with DATA_PATH}"

common_train_args
TRAIN_ARGS+=(--seq-length "$SEQ_LEN" --hidden-dropout 0 --attention-dropout 0
             --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
model_args FFN --ffn-hidden-size ROTARY_BASE --rotary-base QUERY_GROUPS --num-query-groups
if [[ $FROM_CHECKPOINT == 0 ]]; then  # the Llama-style layer; a checkpoint gives its own (tied or untied head, ...)
    TRAIN_ARGS+=(--max-position-embeddings "$SEQ_LEN" --position-embedding-type rope --normalization RMSNorm --swiglu
                 --group-query-attention --disable-bias-linear --untie-embeddings-and-output-weights)
fi

if [[ -n "$DEFAULT_DATA" ]]; then
    preflight gpt --args-only "${TRAIN_ARGS[@]}" "$@"
    build_default_data "$DEFAULT_DATA" hf-bpe "$VOCAB_SIZE"
fi
preflight gpt "${TRAIN_ARGS[@]}" "$@"
echo "Llama-style GPT: tp=$TP, pp=$PP, $TRAIN_ITERS iterations, checkpoints in $SAVE"
launch pretrain_gpt2.py "${TRAIN_ARGS[@]}" "$@"
samples
