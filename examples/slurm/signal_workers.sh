#!/usr/bin/env bash
# signal_workers.sh SIGNAL: send SIGNAL to the training workers of this SLURM job on this node, and to nothing
# else: the children of this job's torchrun agents (the processes running torch.distributed.run or torchrun
# with this SLURM_JOB_ID in their environment). torchrun itself, the batch shell and the DataLoader workers
# forked by a training process are left alone. All of them get the signal in one `kill`. Run by
# examples/slurm/common.sh on every node of the job (`srun --overlap`).
set -euo pipefail
signal=$1
job=${SLURM_JOB_ID:?signal_workers.sh runs inside a SLURM job}

workers=()
for agent in $(pgrep -f -- '(torch\.distributed\.run|torchrun) ' || true); do
    program=$(head -z -n 1 "/proc/$agent/cmdline" 2> /dev/null | tr -d '\0') || continue
    [[ ${program##*/} == python* || ${program##*/} == torchrun ]] || continue  # not srun's own command line
    if grep -qzx "SLURM_JOB_ID=$job" "/proc/$agent/environ" 2> /dev/null; then
        read -r -a children <<< "$(pgrep -d ' ' -P "$agent" || true)"
        workers+=("${children[@]}")
    fi
done
if (( ${#workers[@]} > 0 )); then
    kill -s "$signal" "${workers[@]}" 2> /dev/null || true
fi
echo "signal_workers.sh: SIG$signal to ${#workers[@]} training workers of job $job on $(hostname -s)"
