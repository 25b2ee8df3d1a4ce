# shellcheck shell=bash
# Shared by ds_pretrain_gpt2.sh, ds_pretrain_llama.sh, ds_pretrain_moe.sh and ds_pretrain_t5.sh (sourced, not run):
# layout and run defaults, common arguments, default data and the launcher.
# Expects REPO and PYTHON to be set by the caller.
# Nothing here changes directory: every relative path a user gives (DATA_PATH, VOCAB_FILE, TOKENIZER_MODEL,
# PRETRAINED, LOAD, SAVE, WORK_DIR, DS_CONFIG, HOSTFILE and the extra arguments) means what it means where the
# script was started. The project's scripts are run by their path under REPO, which PYTHONPATH leads to.
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"

# Number of CUDA devices torch sees on this node (0 on a CPU-only machine: without nvidia-smi or rocm-smi
#   torch is not even imported, which keeps a mistake's report under a few seconds).
count_gpus() {
    if ! command -v nvidia-smi > /dev/null 2>&1 && ! command -v rocm-smi > /dev/null 2>&1; then
        echo 0
        return
    fi
    "$PYTHON" -c 'import torch; print(torch.cuda.device_count())'
}

# gpu_precision: --bf16 where this node's GPUs compute bf16 natively (compute capability 8.0 and up: A100, H100,
#   RTX 30xx and later; ROCm's MI200 and later), else --fp16 (V100, T4: their bf16 is emulated, and fp16 with
#   DeepSpeed's loss scaling is what they train in).
gpu_precision() {
    "$PYTHON" -c 'import torch
print("--bf16" if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 0) else "--fp16")'
}

# parallel_defaults: NPROC, TP, PP unless set. With GPUs: every GPU of this node, tp=2 from 2 GPUs and
#   pp=2 from 4. Without: 8 CPU processes at tp=2, pp=2 (gloo, one thread each).
parallel_defaults() {
    if (( NGPUS > 0 )); then
        NPROC=${NPROC:-$NGPUS}
        TP=${TP:-$(( NPROC >= 2 ? 2 : 1 ))}
        PP=${PP:-$(( NPROC >= 4 ? 2 : 1 ))}
    else
        NPROC=${NPROC:-8}; TP=${TP:-2}; PP=${PP:-2}
        export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
    fi
}

# checkpoint_model ARGS...: before the scripts' defaults. FROM_CHECKPOINT=1 when the model comes from a
#   checkpoint: PRETRAINED is set (continued pretraining) or ARGS hold --use-checkpoint-args; the scripts then pass
#   --use-checkpoint-args and none of their own model defaults. MODEL_SET lists the model variables the
#   environment set: those are passed all the same, and pretrain_*.py checks them against the checkpoint.
checkpoint_model() {
    FROM_CHECKPOINT=0
    if [[ -n ${PRETRAINED:-} ]]; then FROM_CHECKPOINT=1; fi
    local arg var
    for arg in "$@"; do
        if [[ $arg == --use-checkpoint-args ]]; then FROM_CHECKPOINT=1; fi
    done
    MODEL_SET=" "
    for var in NUM_LAYERS HIDDEN HEADS QUERY_GROUPS FFN ROTARY_BASE NUM_EXPERTS MOE_FFN TOPK SHARED_FFN; do
        if [[ -n ${!var:-} ]]; then MODEL_SET+="$var "; fi
    done
}

# model_args VAR FLAG [VAR FLAG ...]: FLAG "$VAR" into TRAIN_ARGS for each pair; when the model comes from a
#   checkpoint, only for the variables the environment set.
model_args() {
    while (( $# >= 2 )); do
        if [[ $FROM_CHECKPOINT == 0 || $MODEL_SET == *" $1 "* ]]; then TRAIN_ARGS+=("$2" "${!1}"); fi
        shift 2
    done
}

# run_settings: warm-up, checkpoints, seed, split and launcher defaults (after TRAIN_ITERS and WORK_DIR).
run_settings() {
    WARMUP_ITERS=${WARMUP_ITERS:-$(( TRAIN_ITERS / 10 ))}
    SAVE=${SAVE:-$WORK_DIR/checkpoints}
    LOAD=${LOAD:-$SAVE}
    SEED=${SEED:-1234}
    SPLIT=${SPLIT:-949,50,1}
    LAUNCHER=${LAUNCHER:-$([[ -n "${HOSTFILE:-}" ]] && echo deepspeed || echo torchrun)}
    HOSTFILE=${HOSTFILE:-}
    local port=29500
    if [[ ${SLURM_JOB_ID:-} =~ ^[0-9]+$ ]]; then
        port=$(( 10000 + SLURM_JOB_ID % 20000 ))  # in a SLURM job: megatron.config.launcher_env's rule
    fi
    MASTER_PORT=${MASTER_PORT:-$port}
}

# data_path_args: DATA_PATH into the array DATA_PATH_ARGS. One prefix (spaces allowed), or Megatron's
#   blend "0.7 data/web_text_document 0.3 data/books_text_document" (when the first word is a number).
data_path_args() {
    local first=${DATA_PATH%% *}
    if [[ $first =~ ^[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?$ && $DATA_PATH == *" "* ]]; then
        read -r -a DATA_PATH_ARGS <<< "$DATA_PATH"
    else
        DATA_PATH_ARGS=("$DATA_PATH")
    fi
}

# common_train_args: the pretrain_*.py arguments both models take, into the array TRAIN_ARGS (the model's depth,
#   width and heads unless a checkpoint gives them; PRETRAINED as --pretrained-checkpoint); the caller appends its
#   other model and tokenizer arguments. --zero-stage ZERO_STAGE (default 1). --exit-signal-handler is on
#   (EXIT_SIGNAL_HANDLER=0 turns it off): a SIGTERM or SIGUSR1 to the script saves at the current iteration and
#   exits 0 (forward_signal); EXIT_DURATION_IN_MINS=N does the same after N minutes; ASYNC_SAVE=1 writes
#   checkpoints in the background.
#   The loss runs fused (--cross-entropy-loss-fusion; LOSS_FUSION=0 for the eager form); COMPILE=1 adds --compile.
common_train_args() {
    data_path_args
    TRAIN_ARGS=(
        --tensor-model-parallel-size "$TP" --pipe-parallel-size "$PP" --zero-stage "${ZERO_STAGE:-1}"
        --micro-batch-size "$MICRO_BATCH" --gas "$GAS" --train-iters "$TRAIN_ITERS"
        --lr "$LR" --min-lr "$MIN_LR" --lr-decay-style cosine --lr-warmup-iters "$WARMUP_ITERS"
        --weight-decay 0.01 --clip-grad 1.0
        --data-path "${DATA_PATH_ARGS[@]}" --split "$SPLIT" --num-workers "$NUM_WORKERS" --seed "$SEED"
        --log-interval "$LOG_INTERVAL" --eval-interval "$EVAL_INTERVAL" --eval-iters "$EVAL_ITERS"
        --save "$SAVE" --load "$LOAD" --save-interval "$SAVE_INTERVAL"
        --deepspeed --deepspeed_config "$DS_CONFIG"
    )
    model_args NUM_LAYERS --num-layers HIDDEN --hidden-size HEADS --num-attention-heads
    if [[ -n "${PRETRAINED:-}" ]]; then TRAIN_ARGS+=(--pretrained-checkpoint "$PRETRAINED"); fi
    if [[ $FROM_CHECKPOINT == 1 ]]; then TRAIN_ARGS+=(--use-checkpoint-args); fi
    if [[ ${EXIT_SIGNAL_HANDLER:-1} != 0 ]]; then TRAIN_ARGS+=(--exit-signal-handler); fi
    if [[ ${ASYNC_SAVE:-0} != 0 ]]; then TRAIN_ARGS+=(--async-save); fi
    if [[ ${LOSS_FUSION:-1} != 0 ]]; then TRAIN_ARGS+=(--cross-entropy-loss-fusion); fi
    if [[ ${COMPILE:-0} != 0 ]]; then TRAIN_ARGS+=(--compile); fi
    if [[ -n "${EXIT_DURATION_IN_MINS:-}" ]]; then TRAIN_ARGS+=(--exit-duration-in-mins "$EXIT_DURATION_IN_MINS"); fi
    if [[ -n "$PRECISION" ]]; then TRAIN_ARGS+=("$PRECISION"); fi
    # fp16: DeepSpeed's loss scale starts at 2^32 and halves on each overflow, skipping that step (18 of a 20-step
    # GPU run); start at 2^16 (INITIAL_LOSS_SCALE= leaves it to the DeepSpeed JSON)
    if [[ $PRECISION == --fp16 && -n ${INITIAL_LOSS_SCALE-65536} ]]; then
        TRAIN_ARGS+=(--initial-loss-scale "${INITIAL_LOSS_SCALE-65536}")
    fi
    if [[ -n "$ACTIVATION_CHECKPOINT" ]]; then TRAIN_ARGS+=("$ACTIVATION_CHECKPOINT"); fi
}

# build_default_data DIR TOKENIZER_KIND VOCAB_SIZE
#   The embedded default corpus (docstrings of Python's standard library), a tokenizer trained on it
#   (bpe -> DIR/tokenizer/{vocab.json,merges.txt}, sentencepiece -> DIR/tokenizer/spm.model, hf-bpe ->
#   DIR/tokenizer/tokenizer.json) and the tokenized .bin/.idx with prefix DIR/stdlib_docs_text_document. Skipped
#   when the .idx already exists.
build_default_data() {
    local dir=$1 kind=$2 vocab_size=$3
    local corpus=$dir/stdlib_docs.jsonl tok=$dir/tokenizer
    if [[ -f $dir/stdlib_docs_text_document.idx ]]; then
        return
    fi
    echo "building the default corpus and a $kind tokenizer under $dir"
    "$PYTHON" "$REPO/examples/make_default_corpus.py" --output "$corpus"
    "$PYTHON" "$REPO/tools/train_tokenizer.py" --input "$corpus" --type "$kind" --vocab-size "$vocab_size" \
        --output-dir "$tok"
    local tok_args=(--tokenizer-type GPT2BPETokenizer --vocab-file "$tok/vocab.json" --merge-file "$tok/merges.txt")
    if [[ $kind == sentencepiece ]]; then
        tok_args=(--tokenizer-type SentencePieceTokenizer --tokenizer-model "$tok/spm.model")
    elif [[ $kind == hf-bpe ]]; then
        tok_args=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$tok")
    fi
    "$PYTHON" "$REPO/tools/preprocess_data.py" --input "$corpus" "${tok_args[@]}" --append-eod \
        --output-prefix "$dir/stdlib_docs" --workers 1
}

# world_size: the number of processes the launcher will start (the slots of HOSTFILE with the DeepSpeed
#   launcher; the SLURM job's tasks with srun; NPROC on each of its nodes with srun-torchrun; else NPROC on
#   this node).
world_size() {
    if [[ $LAUNCHER == deepspeed && -n "$HOSTFILE" ]]; then
        awk '!/^[[:space:]]*#/ { for (i = 1; i <= NF; i++) if ($i ~ /^slots=/) { sub(/^slots=/, "", $i); n += $i } }
             END { print n + 0 }' "$HOSTFILE"
    elif [[ $LAUNCHER == srun ]]; then
        echo "${SLURM_NTASKS:?LAUNCHER=srun runs inside a SLURM allocation (sbatch, salloc)}"
    elif [[ $LAUNCHER == srun-torchrun ]]; then
        : "${SLURM_JOB_NUM_NODES:?LAUNCHER=srun-torchrun runs inside a SLURM allocation (sbatch, salloc)}"
        echo $(( NPROC * SLURM_JOB_NUM_NODES ))
    else
        echo "$NPROC"
    fi
}

# preflight MODEL ARGS...: check the arguments and input files in one process, with the world size the
#   launcher will create (python -m megatron.config.preflight, about a second); prints the mistake and exits 2.
#   CHECK_ARGS=0 skips it.
preflight() {
    local model=$1
    shift
    if [[ ${CHECK_ARGS:-1} == 0 ]]; then
        return
    fi
    "$PYTHON" -m megatron.config.preflight "$model" --world-size "$(world_size)" "$@" || exit $?
}

# hide_after FILE: copy stdin to stdout until FILE exists (a process has reported a user error), then drop
#   the rest (the launcher's report of the failed processes and what the others print while stopping). It
#   ignores SIGTERM and SIGUSR1: a signal to the whole job (SLURM's time limit, `kill -- -PGID`) must not cut
#   the log, and the training processes' output, while they save.
hide_after() {
    trap '' TERM USR1
    local line
    while IFS= read -r line || [[ -n $line ]]; do
        [[ -e $1 ]] || printf '%s\n' "$line"
    done
}

# training_processes: the training ranks of this launch, found by ERROR_MARKER_LINE (MEGATRON_ERROR_FILE=...)
#   and LOCAL_RANK in their environment (a launcher sets LOCAL_RANK for its workers, not for itself), with their
#   data-loader workers (which inherit the handler); found wherever they are in the process tree, also once a
#   launcher that received the signal too has died and left them to init.
training_processes() {
    local environ pid
    { grep -lzxF -e "$ERROR_MARKER_LINE" /proc/[0-9]*/environ 2> /dev/null || true; } | while IFS= read -r environ; do
        if grep -qz '^LOCAL_RANK=' "$environ" 2> /dev/null; then
            pid=${environ#/proc/}
            echo "${pid%/environ}"
        fi
    done
}

# forward_signal SIGNAL: a SIGTERM or SIGUSR1 sent to this script (a scheduler's preemption or time limit) goes
#   to the training processes: with --exit-signal-handler they finish the iteration, save a checkpoint and exit
#   0. The launcher is not signalled by the script (megatron.training.torchrun passes a signal it receives to
#   its workers; DeepSpeed's launcher would stop them). When the whole job was signalled, the processes already
#   have it: a second copy changes nothing.
forward_signal() {
    local pids
    SIGNALLED=$1
    pids=$(training_processes)
    echo "received SIG$1: passing it to the training processes ($(echo "$pids" | wc -w))"
    # shellcheck disable=SC2086  # one pid per word
    if [[ -n $pids ]]; then kill -s "$1" $pids 2> /dev/null || true; fi
}

# wait_for_training: after a signal, wait until the training processes of this launch have exited (a launcher
#   that received the signal too may have exited before them: DeepSpeed's).
wait_for_training() {
    while [[ -n $(training_processes) ]]; do
        sleep 0.5
    done
}

# launch SCRIPT ARGS...
#   DRY_RUN=1: print the planner's prediction for the layout (pretrain_*.py --dry-run) and exit, launching nothing.
#   LAUNCHER=torchrun (default; one node, NPROC processes) or deepspeed (HOSTFILE for several nodes,
#   else NPROC local processes; MASTER_PORT). Inside a SLURM allocation (examples/slurm): srun (one task per
#   rank, every task of the job; the ranks come from SLURM's variables) or srun-torchrun (one task per node,
#   each a torchrun of NPROC processes meeting at the job's first node, MASTER_PORT). A user error seen by any
#   process (megatron.errors) is printed once, as `error: ...`, after the launcher has stopped, and the script
#   exits 2.
#   MAX_RESTARTS=N: after a rank fails, start every rank again, up to N times; each start resumes from
#   `latest` (--load = --save). torchrun does it itself (--max-restarts N); DeepSpeed's launcher has no such
#   option, so the script launches it again (not after a user error, which would fail the same way). Under
#   SLURM with srun (one task per rank) a failed step is not restarted.
launch() {
    local script=$1
    shift
    local cmd nodes
    if [[ ${DRY_RUN:-0} == 1 ]]; then  # the planner's prediction for this layout, one process, no model built
        WORLD_SIZE=$(world_size) "$PYTHON" "$REPO/$script" "$@" --dry-run || exit $?
        exit 0
    fi
    case "$LAUNCHER" in
        torchrun)
            cmd=("$PYTHON" -m megatron.training.torchrun --nproc_per_node "$NPROC" --standalone
                 --max-restarts "${MAX_RESTARTS:-0}") ;;
        deepspeed)
            cmd=(deepspeed --master_port "$MASTER_PORT")
            if [[ -n "$HOSTFILE" ]]; then cmd+=(--hostfile "$HOSTFILE"); else cmd+=(--num_gpus "$NPROC"); fi ;;
        srun)
            cmd=(srun --kill-on-bad-exit=1 "$PYTHON") ;;
        srun-torchrun)
            nodes=$SLURM_JOB_NUM_NODES
            cmd=(srun --nodes "$nodes" --ntasks "$nodes" --ntasks-per-node 1 --kill-on-bad-exit=1
                 "$PYTHON" -m megatron.training.torchrun --nnodes "$nodes" --nproc_per_node "$NPROC"
                 --max-restarts "${MAX_RESTARTS:-0}" --rdzv_backend c10d --rdzv_id "$SLURM_JOB_ID"
                 --rdzv_endpoint "$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):$MASTER_PORT") ;;
        *)
            echo "error: LAUNCHER must be torchrun, deepspeed, srun or srun-torchrun, got '$LAUNCHER'" >&2
            return 2 ;;
    esac
    local attempt=0 status=0 procs
    procs=$(world_size)
    while :; do
        launch_once "$script" "$@" && status=0 || status=$?
        if [[ $LAUNCHER != deepspeed || $status == 0 || $status == 2 || -n $SIGNALLED ]] \
            || (( attempt >= ${MAX_RESTARTS:-0} )); then
            return "$status"
        fi
        attempt=$(( attempt + 1 ))
        echo "the launcher exited with status $status: restart $attempt of ${MAX_RESTARTS} (resumes from latest)"
    done
}

# launch_once SCRIPT ARGS...: one run of the launcher command `cmd` for `procs` processes (see launch). A
#   SIGTERM or SIGUSR1 to the script goes to the training processes (forward_signal); once the launcher has
#   exited the script waits for them, and when they stopped cleanly (the last rank-0 step of the run writes
#   MEGATRON_STOP_FILE) it exits 0 whatever the launcher's status (DeepSpeed's launcher exits 1 after it
#   received SIGTERM itself, although its workers saved and exited 0).
launch_once() {
    local script=$1
    shift
    echo "launching: ${cmd[*]} $script ($procs processes)"
    local error_file stop_file status out_pid err_pid
    error_file=$(mktemp -u "${TMPDIR:-/tmp}/megatron-error.XXXXXXXX")
    stop_file=$error_file.stopped
    ERROR_MARKER_LINE="MEGATRON_ERROR_FILE=$error_file"
    SIGNALLED=
    exec 3> >(hide_after "$error_file")
    out_pid=$!
    exec 4> >(hide_after "$error_file" >&2)
    err_pid=$!
    status=0
    MEGATRON_ERROR_FILE=$error_file MEGATRON_STOP_FILE=$stop_file "${cmd[@]}" "$REPO/$script" "$@" >&3 2>&4 3>&- 4>&- &
    local launcher_pid=$!
    trap 'forward_signal TERM' TERM
    trap 'forward_signal USR1' USR1
    while :; do  # a trapped signal interrupts `wait`; wait again until the launcher has exited
        wait "$launcher_pid" && status=0 || status=$?
        kill -0 "$launcher_pid" 2> /dev/null || break
    done
    if [[ -n $SIGNALLED ]]; then
        wait_for_training
        if (( status != 0 )) && [[ -s $stop_file && ! -s $error_file ]]; then
            echo "the launcher exited with status $status after SIG$SIGNALLED; the training processes stopped" \
                "cleanly: $(head -n 1 "$stop_file")"
            status=0
        fi
    fi
    trap - TERM USR1
    exec 3>&- 4>&-
    wait "$out_pid" "$err_pid" 2>/dev/null || true  # the filters have printed everything
    rm -f "$stop_file"
    if [[ -s $error_file ]]; then
        echo "error: $(head -n 1 "$error_file")" >&2
        rm -f "$error_file"
        return 2
    fi
    return "$status"
}

# samples: two short samples from the checkpoint in SAVE (tools/generate.py; SAMPLES=0 skips them), each cut at
#   its first blank line. A small model decoded greedily repeats its likeliest words ("the the the"), so they are
#   drawn as docs/generation.md suggests for one: top-k 40 at temperature 0.8, seed 1234 (the same text every
#   time from the same checkpoint).
samples() {
    if [[ ${SAMPLES:-1} == 0 ]]; then
        return
    fi
    echo "samples from the checkpoint in $SAVE (top-k 40, temperature 0.8, seed 1234):"
    "$PYTHON" "$REPO/tools/generate.py" --load "$SAVE" --max-new-tokens 24 --stop $'\n\n' \
        --top-k 40 --temperature 0.8 --seed 1234 --prompt "Return the number of" --prompt "Return a list of"
}
