#!/usr/bin/env bash
# Pretrain GPT-2 with tensor x pipeline x data parallelism (Megatron layers, TDS pipeline, DeepSpeed ZeRO-1).
#
#   bash examples/ds_pretrain_gpt2.sh [extra pretrain_gpt2.py arguments]
#
# Every setting below is a variable that the environment overrides, e.g.
#   TRAIN_ITERS=20 bash examples/ds_pretrain_gpt2.sh                      a short run
#   TP=1 PP=4 NPROC=8 bash examples/ds_pretrain_gpt2.sh                   another layout
#   DATA_PATH=data/my_text_document VOCAB_FILE=... MERGE_FILE=... bash ...   your own preprocessed data
#   DATA_PATH="0.7 data/web_text_document 0.3 data/books_text_document" ...  a blend (Megatron's form)
#   PRETRAINED=runs/imported bash ...   continue an imported GPT-2 (import-hf): the model comes from it
#   LAUNCHER=deepspeed HOSTFILE=hostfile bash ...                         several nodes ("host slots=N" lines)
#   kill -TERM <this script's pid>     (or SIGUSR1)   save at the current iteration, exit 0; run again to resume
#   MAX_RESTARTS=3 bash ...              a failed rank restarts every rank (up to 3 times), resuming from latest
#
# Relative paths mean what they mean where the script is started (it never changes directory); its outputs go to
# WORK_DIR, runs/gpt2 under that folder by default.
# Without DATA_PATH the embedded default corpus is used: the docstrings of Python's standard library
# (examples/make_default_corpus.py), a byte-level BPE tokenizer trained on it (tools/train_tokenizer.py)
# and its .bin/.idx (tools/preprocess_data.py), all built once under WORK_DIR.
# Without GPUs: a tiny GPT-2 on 8 CPU processes (tp=2, pp=2, dp=2, gloo, one thread each), 200 iterations,
# a few minutes on 2 cores. With GPUs: every GPU of this node and a GPT-2 medium-sized model in bf16 (fp16 on GPUs
# before compute capability 8.0).
# The arguments and input files are checked in one process before the launch (python -m megatron.config.preflight;
# CHECK_ARGS=0 skips it): a mistake prints one `error: ...` line and the script exits 2.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYTHON=${PYTHON:-python}
# shellcheck source=examples/common.sh
source "$REPO/examples/common.sh"
NGPUS=${NGPUS:-$(count_gpus)}
WORK_DIR=${WORK_DIR:-$PWD/runs/gpt2}
checkpoint_model "$@"

parallel_defaults
if (( NGPUS > 0 )); then
    NUM_LAYERS=${NUM_LAYERS:-24}; HIDDEN=${HIDDEN:-1024}; HEADS=${HEADS:-16}; SEQ_LEN=${SEQ_LEN:-1024}
    MICRO_BATCH=${MICRO_BATCH:-4}; GAS=${GAS:-16}; TRAIN_ITERS=${TRAIN_ITERS:-20000}
    LR=${LR:-1.5e-4}; MIN_LR=${MIN_LR:-1e-5}; VOCAB_SIZE=${VOCAB_SIZE:-8192}
    PRECISION=${PRECISION-$(gpu_precision)}; ACTIVATION_CHECKPOINT=${ACTIVATION_CHECKPOINT---checkpoint-activations}
    LOG_INTERVAL=${LOG_INTERVAL:-10}; EVAL_INTERVAL=${EVAL_INTERVAL:-1000}; EVAL_ITERS=${EVAL_ITERS:-10}
    SAVE_INTERVAL=${SAVE_INTERVAL:-1000}; NUM_WORKERS=${NUM_WORKERS:-2}
else
    NUM_LAYERS=${NUM_LAYERS:-4}; HIDDEN=${HIDDEN:-64}; HEADS=${HEADS:-4}; SEQ_LEN=${SEQ_LEN:-64}
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
    VOCAB_FILE=$DEFAULT_DATA/tokenizer/vocab.json
    MERGE_FILE=$DEFAULT_DATA/tokenizer/merges.txt
fi

common_train_args
TRAIN_ARGS+=(--seq-length "$SEQ_LEN" --tokenizer-type GPT2BPETokenizer)
if [[ $FROM_CHECKPOINT == 0 ]]; then TRAIN_ARGS+=(--max-position-embeddings "$SEQ_LEN"); fi
if [[ -n "${VOCAB_FILE:-}" ]]; then TRAIN_ARGS+=(--vocab-file "$VOCAB_FILE"); fi
if [[ -n "${MERGE_FILE:-}" ]]; then TRAIN_ARGS+=(--merge-file "$MERGE_FILE"); fi

if [[ -n "$DEFAULT_DATA" ]]; then
    preflight gpt --args-only "${TRAIN_ARGS[@]}" "$@"
    build_default_data "$DEFAULT_DATA" bpe "$VOCAB_SIZE"
fi
preflight gpt "${TRAIN_ARGS[@]}" "$@"
echo "GPT-2: tp=$TP, pp=$PP, $TRAIN_ITERS iterations, checkpoints in $SAVE"
launch pretrain_gpt2.py "${TRAIN_ARGS[@]}" "$@"
samples
