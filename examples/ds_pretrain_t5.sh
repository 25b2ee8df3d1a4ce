#!/usr/bin/env bash
# Pretrain T5 (span corruption) with tensor x pipeline x data parallelism (TDS pipeline, DeepSpeed ZeRO-1).
#
#   bash examples/ds_pretrain_t5.sh [extra pretrain_t5.py arguments]
#
# Settings are variables that the environment overrides (see ds_pretrain_gpt2.sh for examples), e.g.
#   TRAIN_ITERS=20 bash examples/ds_pretrain_t5.sh
#   DATA_PATH=data/my_text_document TOKENIZER_MODEL=spm.model bash examples/ds_pretrain_t5.sh
# DATA_PATH is GPT-style document data (tools/preprocess_data.py, SentencePiece tokenizer); spans are
# corrupted at load time. --num-layers is the depth of the encoder, and of the decoder unless
# --decoder-num-layers is given. T5 v1.1: bash examples/ds_pretrain_t5.sh --feed-forward-proj gated-gelu \
#   --untie-embeddings-and-output-weights
# PRETRAINED=runs/imported (an import-hf of a T5 folder) continues it: the model comes from it.
# Relative paths mean what they mean where the script is started; outputs go to WORK_DIR (runs/t5 there).
# Without DATA_PATH: the stdlib-docstring corpus with a SentencePiece tokenizer trained on it (WORK_DIR).
# Without GPUs: a tiny T5 on 8 CPU processes (tp=2, pp=2, dp=2, gloo); with GPUs: all of them, T5-base size.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
# shellcheck source=examples/common.sh
source "$REPO/examples/common.sh"
NGPUS=${NGPUS:-$(count_gpus)}
WORK_DIR=${WORK_DIR:-$PWD/runs/t5}
checkpoint_model "$@"

parallel_defaults
if (( NGPUS > 0 )); then
    NUM_LAYERS=${NUM_LAYERS:-12}; HIDDEN=${HIDDEN:-768}; HEADS=${HEADS:-12}; FFN=${FFN:-3072}
    ENC_LEN=${ENC_LEN:-512}; DEC_LEN=${DEC_LEN:-128}
    MICRO_BATCH=${MICRO_BATCH:-8}; GAS=${GAS:-8}; TRAIN_ITERS=${TRAIN_ITERS:-20000}
    LR=${LR:-1e-4}; MIN_LR=${MIN_LR:-1e-5}; VOCAB_SIZE=${VOCAB_SIZE:-8000}
    PRECISION=${PRECISION-$(gpu_precision)}; ACTIVATION_CHECKPOINT=${ACTIVATION_CHECKPOINT---checkpoint-activations}
    LOG_INTERVAL=${LOG_INTERVAL:-10}; EVAL_INTERVAL=${EVAL_INTERVAL:-1000}; EVAL_ITERS=${EVAL_ITERS:-10}
    SAVE_INTERVAL=${SAVE_INTERVAL:-1000}; NUM_WORKERS=${NUM_WORKERS:-2}
else
    NUM_LAYERS=${NUM_LAYERS:-2}; HIDDEN=${HIDDEN:-64}; HEADS=${HEADS:-4}; FFN=${FFN:-256}
    ENC_LEN=${ENC_LEN:-64}; DEC_LEN=${DEC_LEN:-32}
    MICRO_BATCH=${MICRO_BATCH:-4}; GAS=${GAS:-2}; TRAIN_ITERS=${TRAIN_ITERS:-200}
    LR=${LR:-2e-3}; MIN_LR=${MIN_LR:-2e-4}; VOCAB_SIZE=${VOCAB_SIZE:-2000}
    PRECISION=${PRECISION:-}; ACTIVATION_CHECKPOINT=${ACTIVATION_CHECKPOINT:-}
    LOG_INTERVAL=${LOG_INTERVAL:-10}; EVAL_INTERVAL=${EVAL_INTERVAL:-100}; EVAL_ITERS=${EVAL_ITERS:-2}
    SAVE_INTERVAL=${SAVE_INTERVAL:-100}; NUM_WORKERS=${NUM_WORKERS:-0}
fi
run_settings
VOCAB_EXTRA_IDS=${VOCAB_EXTRA_IDS:-100}
MASK_PROB=${MASK_PROB:-0.15}
DS_CONFIG=${DS_CONFIG:-$REPO/examples/ds_config_t5.json}

DEFAULT_DATA=
if [[ -z "${DATA_PATH:-}" ]]; then
    DEFAULT_DATA=$WORK_DIR/data
    DATA_PATH=$DEFAULT_DATA/stdlib_docs_text_document
    TOKENIZER_MODEL=$DEFAULT_DATA/tokenizer/spm.model
fi

common_train_args
TRAIN_ARGS+=(
    --encoder-seq-length "$ENC_LEN" --decoder-seq-length "$DEC_LEN"
    --tokenizer-type SentencePieceTokenizer --vocab-extra-ids "$VOCAB_EXTRA_IDS" --mask-prob "$MASK_PROB"
)
model_args FFN --ffn-hidden-size
if [[ -n "${TOKENIZER_MODEL:-}" ]]; then TRAIN_ARGS+=(--tokenizer-model "$TOKENIZER_MODEL"); fi

if [[ -n "$DEFAULT_DATA" ]]; then
    preflight t5 --args-only "${TRAIN_ARGS[@]}" "$@"
    build_default_data "$DEFAULT_DATA" sentencepiece "$VOCAB_SIZE"
fi
preflight t5 "${TRAIN_ARGS[@]}" "$@"
echo "T5: tp=$TP, pp=$PP, $TRAIN_ITERS iterations, checkpoints in $SAVE"
launch pretrain_t5.py "${TRAIN_ARGS[@]}" "$@"
