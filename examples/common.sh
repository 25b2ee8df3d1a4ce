# shellcheck shell=bash
# Shared by ds_pretrain_gpt2.sh and ds_pretrain_t5.sh (sourced, not run): default data and the launcher.
# Expects REPO and PYTHON to be set by the caller.

# Number of CUDA devices torch sees on this node (0 on a CPU-only machine).
count_gpus() {
    "$PYTHON" -c 'import torch; print(torch.cuda.device_count())'
}

# build_default_data DIR TOKENIZER_KIND VOCAB_SIZE
#   The embedded default corpus (docstrings of Python's standard library), a tokenizer trained on it
#   (bpe -> DIR/tokenizer/{vocab.json,merges.txt}, sentencepiece -> DIR/tokenizer/spm.model) and the
#   tokenized .bin/.idx with prefix DIR/stdlib_docs_text_document. Skipped when the .idx already exists.
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
    fi
    "$PYTHON" "$REPO/tools/preprocess_data.py" --input "$corpus" "${tok_args[@]}" --append-eod \
        --output-prefix "$dir/stdlib_docs" --workers 1
}

# launch SCRIPT ARGS...
#   LAUNCHER=torchrun (default; one node, NPROC processes) or deepspeed (HOSTFILE for several nodes,
#   else NPROC local processes; MASTER_PORT).
launch() {
    local script=$1
    shift
    local cmd
    case "$LAUNCHER" in
        torchrun)
            cmd=("$PYTHON" -m torch.distributed.run --nproc_per_node "$NPROC" --standalone) ;;
        deepspeed)
            cmd=(deepspeed --master_port "$MASTER_PORT")
            if [[ -n "$HOSTFILE" ]]; then cmd+=(--hostfile "$HOSTFILE"); else cmd+=(--num_gpus "$NPROC"); fi ;;
        *)
            echo "LAUNCHER must be torchrun or deepspeed, got '$LAUNCHER'" >&2
            return 2 ;;
    esac
    echo "launching: ${cmd[*]} $script ($NPROC processes per node)"
    cd "$REPO" || return
    exec "${cmd[@]}" "$script" "$@"
}
