#!/usr/bin/env bash
# signal_workers.sh SIGNAL: send SIGNAL to the training workers of this SLURM job on this node, and to nothing
# else: the processes that torchrun started (TORCHELASTIC_RUN_ID and LOCAL_RANK in their environment, the
# job's SLURM_JOB_ID) whose parent is not such a process. torchrun itself, the batch shell and the DataLoader
# workers forked by a training process are left alone. Run by examples/slurm/common.sh on every node
# (`srun --overlap`).
set -euo pipefail
signal=$1
job=${SLURM_JOB_ID:?signal_workers.sh runs inside a SLURM job}

is_worker() {  # is_worker PID
    local env
    env=$(tr '\0' '\n' < "/proc/$1/environ" 2> /dev/null) || return 1
    grep -qx "SLURM_JOB_ID=$job" <<< "$env" && grep -q '^TORCHELASTIC_RUN_ID=' <<< "$env" \
        && grep -q '^LOCAL_RANK=' <<< "$env"
}

count=0
for dir in /proc/[0-9]*; do
    pid=${dir#/proc/}
    is_worker "$pid" || continue
    parent=$(awk '/^PPid:/ { print $2 }' "$dir/status" 2> /dev/null) || continue
    if [[ -n $parent ]] && is_worker "$parent"; then
        continue
    fi
    kill -s "$signal" "$pid" 2> /dev/null && count=$(( count + 1 ))
done
echo "signal_workers.sh: SIG$signal to $count training workers of job $job on $(hostname -s)"
