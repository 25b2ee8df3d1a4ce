# shellcheck shell=bash
# Shared by the sbatch scripts of examples/slurm (sourced, not run): run examples/ds_pretrain_*.sh inside the
# SLURM job in one of two styles, forward the preemption signal where it is needed, requeue an unfinished run.
#
#   slurm_train srun|torchrun gpt2|t5 [pretrain_*.py arguments]
#
# srun      one task per rank: `srun python pretrain_*.py` (LAUNCHER=srun); every rank reads its rank, the
#           world size and the master address from SLURM's variables (megatron.config.launcher_env). The
#           signal of `#SBATCH --signal=USR1@120` or `scancel --signal=...` reaches the ranks themselves.
# torchrun  one task per node, each `torchrun --nproc_per_node NPROC` (LAUNCHER=srun-torchrun, through
#           megatron.training.torchrun, which passes a SIGTERM or SIGUSR1 to its workers instead of stopping
#           them). The signal goes to this batch shell (`--signal=B:USR1@120`, `scancel --batch --signal=...`)
#           and is forwarded to the training workers on every node (examples/slurm/signal_workers.sh).
# In both styles this shell survives SIGTERM and SIGUSR1 and waits for the run: SLURM's time limit without
# `--signal` (and `scancel` without `--batch`) sends SIGTERM to every process of the job, this shell included,
# and SIGKILL KillWait (30 s by default) later; the ranks save in between.
#
# The ranks train with --exit-signal-handler (examples/common.sh passes it): on the signal every rank finishes
# its iteration, saves a checkpoint there and exits 0. The run resumes from `latest` in SAVE. When the step
# ended with status 0 and the checkpoint in SAVE is before the run's last iteration, the job requeues itself
# (`scontrol requeue`, with `#SBATCH --requeue`; SLURM starts a requeued job slurm.conf's AuthInfo
# cred_expire later, 120 s by default). REQUEUE=0 turns that off.
#
# Submit from the repository root, or from any folder with REPO=/path/to/repo (SLURM runs a copy of the script,
# so REPO defaults to SLURM_SUBMIT_DIR). Every variable of examples/ds_pretrain_*.sh overrides a setting
# (TRAIN_ITERS, TP, PP, WORK_DIR, ...); relative paths mean the folder the job was submitted from (its working
# directory; nothing changes it); SAVE defaults to WORK_DIR/checkpoints and WORK_DIR to runs/<model> there.

REPO=${REPO:-${SLURM_SUBMIT_DIR:?submit with sbatch from the repository root, or set REPO}}
PYTHON=${PYTHON:-python}
export REPO PYTHON

# forward_to_workers SIGNAL: SIGNAL to the training workers of this job on each of its nodes (a step that
#   shares the job's CPUs with the running one).
forward_to_workers() {
    echo "batch shell: SIG$1 received, forwarding it to the training workers"
    srun --overlap --nodes "$SLURM_JOB_NUM_NODES" --ntasks "$SLURM_JOB_NUM_NODES" --ntasks-per-node 1 \
        bash "$REPO/examples/slurm/signal_workers.sh" "$1" || true
}

# unfinished DIR: true when the checkpoint `latest` names in DIR is before the iteration its run trains to.
unfinished() {
    [[ -f $1/latest ]] || return 1
    "$PYTHON" - "$1" << 'PY'
import json, os, sys
save = sys.argv[1]
tag = open(os.path.join(save, "latest")).read().strip()
args = json.load(open(os.path.join(save, tag, "megatron_args.json")))
sys.exit(0 if int(tag[len("iter_"):]) < args["train_iters"] else 1)
PY
}

slurm_train() {
    local style=$1 model=$2
    shift 2
    case $style in
        srun) export LAUNCHER=srun ;;
        torchrun) export LAUNCHER=srun-torchrun ;;
        *) echo "error: slurm_train: style must be srun or torchrun, got '$style'" >&2; return 2 ;;
    esac
    export WORK_DIR=${WORK_DIR:-$PWD/runs/$model}
    export SAVE=${SAVE:-$WORK_DIR/checkpoints}
    export SAMPLES=${SAMPLES:-0}
    echo "SLURM job ${SLURM_JOB_ID} (restart ${SLURM_RESTART_COUNT:-0}) on ${SLURM_JOB_NODELIST}: $model, $style style"
    bash "$REPO/examples/ds_pretrain_$model.sh" "$@" &
    local run=$! status
    if [[ $style == torchrun ]]; then
        trap 'forward_to_workers USR1' USR1
        trap 'forward_to_workers TERM' TERM
    else  # the ranks have it (from SLURM, or from ds_pretrain_*.sh); this shell waits for them to save
        trap 'echo "batch shell: SIGUSR1 received, waiting for the ranks to save"' USR1
        trap 'echo "batch shell: SIGTERM received, waiting for the ranks to save"' TERM
    fi
    while true; do
        status=0
        wait "$run" || status=$?
        # a trapped signal ends `wait` early (status > 128) while the run goes on: wait again
        kill -0 "$run" 2> /dev/null || break
    done
    trap - USR1 TERM
    if (( status == 0 )) && [[ ${REQUEUE:-1} == 1 ]] && unfinished "$SAVE"; then
        echo "the run stopped before its last iteration (checkpoint $(cat "$SAVE/latest")):" \
            "requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
    fi
    return "$status"
}
