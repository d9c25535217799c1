#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for development and tests: munged, slurmctld and
# one slurmd per node (n1..nN), each node with its own port, spool, pid and log files.
#
#   ops/slurm/local-cluster.sh up       # start it (idempotent); prints the SLURM_CONF to export
#   ops/slurm/local-cluster.sh status   # sinfo
#   ops/slurm/local-cluster.sh down     # cancel jobs, stop the daemons
#
# LAZARUS_SLURM_DIR (default /tmp/lazarus-slurm) holds the config, state and logs;
# LAZARUS_SLURM_NODES (default 4) sets the node count; LAZARUS_SLURM_PORT the controller port
# (default 16817) and LAZARUS_SLURM_NODE_PORT the first slurmd port (default 17001).
# Needs root (slurmd runs jobs as their users) and Debian's slurm-wlm and munge
# (`ops/setup.sh slurm` installs them).
set -euo pipefail

DIR=${LAZARUS_SLURM_DIR:-/tmp/lazarus-slurm}
NODES=${LAZARUS_SLURM_NODES:-4}
PORT=${LAZARUS_SLURM_PORT:-16817}
NODE_PORT=${LAZARUS_SLURM_NODE_PORT:-17001}
HOST=$(hostname -s)
export SLURM_CONF=$DIR/slurm.conf

die() { echo "local-cluster: $*" >&2; exit 1; }

write_config() {
    mkdir -p "$DIR"/{state,run,log,spool}
    local last=$((NODE_PORT + NODES - 1))
    cat > "$SLURM_CONF" <<CONF
ClusterName=lazarus
SlurmctldHost=$HOST(127.0.0.1)
SlurmctldPort=$PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# A requeued job is held for the credential lifetime (default 120 s) before it may start
# again; a short one keeps the preemption test quick.
AuthInfo=cred_expire=10
CredType=cred/munge
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool/%n
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$DIR/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/linear
ReturnToService=2
SlurmctldTimeout=10
SlurmdTimeout=10
MessageTimeout=5
InactiveLimit=0
KillWait=5
KillOnBadExit=1
MinJobAge=30
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=n[1-$NODES] NodeHostname=$HOST NodeAddr=127.0.0.1 Port=[$NODE_PORT-$last] CPUs=2 RealMemory=4000 State=UNKNOWN
PartitionName=main Nodes=n[1-$NODES] Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:8
CONF
}

alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start_munge() {
    if pgrep -x munged >/dev/null; then return; fi
    mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
    if [ ! -s /etc/munge/munge.key ]; then
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
    chmod 0700 /etc/munge
    chmod 0400 /etc/munge/munge.key
    munged --force
}

up() {
    [ "$(id -u)" = 0 ] || die "run as root"
    command -v slurmctld >/dev/null || die "slurmctld is missing: run ops/setup.sh slurm"
    write_config
    start_munge
    alive "$DIR/run/slurmctld.pid" || slurmctld
    for i in $(seq 1 "$NODES"); do
        alive "$DIR/run/slurmd-n$i.pid" || slurmd -N "n$i"
    done
    for _ in $(seq 1 100); do
        local idle
        idle=$(sinfo -h -N -o '%N %t' 2>/dev/null | awk '$2 ~ /^idle/ {n++} END {print n+0}')
        if [ "$idle" -ge "$NODES" ]; then
            echo "local Slurm cluster up: $NODES nodes (n1..n$NODES). export SLURM_CONF=$SLURM_CONF"
            return
        fi
        # Nodes drained by an earlier run (or down after a restart) come back.
        scontrol update nodename="n[1-$NODES]" state=resume >/dev/null 2>&1 || true
        sleep 0.2
    done
    sinfo -N >&2 || true
    die "nodes did not become idle; see $DIR/log"
}

down() {
    [ -f "$SLURM_CONF" ] || { echo "no local cluster at $DIR"; return; }
    scancel --full -u root >/dev/null 2>&1 || true
    for pid in "$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid"; do
        alive "$pid" && kill "$(cat "$pid")" 2>/dev/null || true
    done
    for _ in $(seq 1 50); do
        pgrep -f "slurmd -N n" >/dev/null || pgrep -x slurmctld >/dev/null || break
        sleep 0.1
    done
    echo "local Slurm cluster down"
}

case "${1:-status}" in
    up) up ;;
    down) down ;;
    status) [ -f "$SLURM_CONF" ] && sinfo -N || echo "no local cluster at $DIR" ;;
    *) die "usage: $0 up|down|status" ;;
esac
