#!/usr/bin/env bash
# A real one-node SLURM cluster on this machine, for tests/slurm (make test-slurm); nothing is mocked.
#
#   tests/slurm/cluster.sh start     install slurm-wlm and munge if missing (apt-get), write the configuration,
#                                    start munged, slurmctld and slurmd, wait until the node is idle
#   tests/slurm/cluster.sh stop      cancel the jobs left, stop the three daemons, delete the state (the daemons'
#                                    logs stay in CLUSTER_DIR-logs)
#   tests/slurm/cluster.sh env       print `export SLURM_CONF=...` (eval it to use sinfo/srun/sbatch by hand)
#
# Everything lives in CLUSTER_DIR (default /tmp/megatron-slurm-cluster): slurm.conf, cgroup.conf, a munge key
# and socket of its own, the state and spool directories, the daemons' pid and log files. The system's
# /etc/slurm and /etc/munge are not used; the client commands find the configuration through SLURM_CONF.
# The node is this host (`hostname -s`) at 127.0.0.1 with 8 CPUs (SlurmdParameters=config_overrides: 8 task
# slots whatever the real core count), OverSubscribe=FORCE on the partition, proctrack/linuxproc,
# task/none and no cgroups, so it runs in a container; the daemons run as root (SlurmUser=root) on the
# ports SLURMCTLD_PORT / SLURMD_PORT (16817 / 16818 unless set). A requeued job may start again
# cred_expire=10 s after its requeue (SLURM's default is 120 s), and the scheduler looks every 5 s.
set -euo pipefail

CLUSTER_DIR=${CLUSTER_DIR:-/tmp/megatron-slurm-cluster}
SLURMCTLD_PORT=${SLURMCTLD_PORT:-16817}
SLURMD_PORT=${SLURMD_PORT:-16818}
NODE=$(hostname -s)
export SLURM_CONF=$CLUSTER_DIR/slurm.conf

install_packages() {
    if command -v slurmctld > /dev/null && command -v slurmd > /dev/null && command -v munged > /dev/null \
        && command -v sbatch > /dev/null; then
        return
    fi
    echo "installing slurm-wlm and munge (apt-get)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -q > /dev/null
    apt-get install -y -q --no-install-recommends slurm-wlm munge > /dev/null
}

write_config() {
    mkdir -p "$CLUSTER_DIR"/{state,spool,log,munge}
    chmod 700 "$CLUSTER_DIR/munge"
    if [[ ! -s $CLUSTER_DIR/munge/munge.key ]]; then
        dd if=/dev/urandom of="$CLUSTER_DIR/munge/munge.key" bs=1024 count=1 status=none
        chmod 400 "$CLUSTER_DIR/munge/munge.key"
    fi
    cat > "$SLURM_CONF" << EOF
ClusterName=megatron-test
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$SLURMCTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$CLUSTER_DIR/munge/munge.socket,cred_expire=10
StateSaveLocation=$CLUSTER_DIR/state
SlurmdSpoolDir=$CLUSTER_DIR/spool
SlurmctldPidFile=$CLUSTER_DIR/slurmctld.pid
SlurmdPidFile=$CLUSTER_DIR/slurmd.pid
SlurmctldLogFile=$CLUSTER_DIR/log/slurmctld.log
SlurmdLogFile=$CLUSTER_DIR/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=5,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
KillWait=30
MinJobAge=600
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=8 Boards=1 SocketsPerBoard=1 CoresPerSocket=8 ThreadsPerCore=1 State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
EOF
    cat > "$CLUSTER_DIR/cgroup.conf" << EOF
# not used: proctrack/linuxproc and task/none need no cgroups (this cluster runs inside containers)
CgroupAutomount=no
EOF
}

running() {  # running PIDFILE: the daemon whose pid the file holds is alive
    [[ -s $1 ]] && kill -0 "$(cat "$1")" 2> /dev/null
}

wait_idle() {
    local state=""
    for _ in $(seq 1 60); do
        state=$(sinfo -h -n "$NODE" -o %T 2> /dev/null || true)
        if [[ $state == idle* ]]; then
            echo "SLURM cluster up: node $NODE idle (SLURM_CONF=$SLURM_CONF)"
            return
        fi
        sleep 1
    done
    echo "error: the node did not become idle within 60 s (state '${state:-no answer}'); logs in $CLUSTER_DIR/log" >&2
    tail -n 20 "$CLUSTER_DIR"/log/*.log >&2 || true
    return 1
}

start() {
    install_packages
    write_config
    local m=$CLUSTER_DIR/munge
    if ! running "$m/munged.pid"; then
        munged --force --key-file="$m/munge.key" --socket="$m/munge.socket" --pid-file="$m/munged.pid" \
            --log-file="$CLUSTER_DIR/log/munged.log" --seed-file="$m/munged.seed"
    fi
    running "$CLUSTER_DIR/slurmctld.pid" || slurmctld -f "$SLURM_CONF"
    running "$CLUSTER_DIR/slurmd.pid" || slurmd -f "$SLURM_CONF"
    wait_idle
}

stop_daemon() {  # stop_daemon PIDFILE: SIGTERM, then SIGKILL after 10 s
    local pidfile=$1 pid
    running "$pidfile" || return 0
    pid=$(cat "$pidfile")
    kill "$pid"
    for _ in $(seq 1 20); do
        kill -0 "$pid" 2> /dev/null || return 0
        sleep 0.5
    done
    kill -9 "$pid" 2> /dev/null || true
}

stop() {
    if [[ ! -d $CLUSTER_DIR ]]; then
        return
    fi
    if running "$CLUSTER_DIR/slurmctld.pid"; then
        scancel --full --signal=KILL --user "$(id -un)" 2> /dev/null || true
        sleep 1
    fi
    stop_daemon "$CLUSTER_DIR/slurmd.pid"
    stop_daemon "$CLUSTER_DIR/slurmctld.pid"
    stop_daemon "$CLUSTER_DIR/munge/munged.pid"
    rm -rf "$CLUSTER_DIR-logs"
    mv "$CLUSTER_DIR/log" "$CLUSTER_DIR-logs"
    rm -rf "$CLUSTER_DIR"
    echo "SLURM cluster stopped (its logs: $CLUSTER_DIR-logs)"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    env) echo "export SLURM_CONF=$SLURM_CONF" ;;
    *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
