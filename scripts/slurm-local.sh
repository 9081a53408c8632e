#!/usr/bin/env bash
# A one-node Slurm cluster on this machine (root; Debian's slurm-wlm), for
# the Slurm tests and for trying examples/deploy/slurm.sbatch by hand.
#
#   slurm-local.sh up DIR     write DIR/slurm.conf, start munged, slurmctld, slurmd
#   slurm-local.sh down DIR   stop them
#
# Then, with SLURM_CONF=DIR/slurm.conf: sbatch, srun, squeue as usual. The
# node offers 8 CPUs whatever this machine has, so a 4-task step fits on 2 cores.
set -euo pipefail

die() { echo "slurm-local: $*" >&2; exit 1; }

up() {
    local dir=$1 host
    command -v slurmctld >/dev/null || die "slurmctld is missing: apt-get install slurm-wlm"
    host=$(hostname -s)
    mkdir -p "$dir/state" "$dir/spool"
    cat >"$dir/slurm.conf" <<CONF
ClusterName=chorus
SlurmctldHost=$host
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
SlurmdParameters=config_overrides
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmdSpoolDir=$dir/spool
StateSaveLocation=$dir/state
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
NodeName=$host CPUs=8 State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
    if ! pgrep -x munged >/dev/null; then
        mkdir -p /run/munge /var/log/munge /var/lib/munge /etc/munge
        [ -s /etc/munge/munge.key ] || dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2>/dev/null
        chmod 400 /etc/munge/munge.key
        munged --force
    fi
    slurmctld -f "$dir/slurm.conf"
    slurmd -f "$dir/slurm.conf"
    # Ready once the node answers idle.
    for _ in $(seq 1 100); do
        if SLURM_CONF="$dir/slurm.conf" sinfo -h -o %t 2>/dev/null | grep -qx idle; then
            return 0
        fi
        sleep 0.2
    done
    die "the node did not come up; see $dir/slurmctld.log and $dir/slurmd.log"
}

down() {
    local dir=$1 f
    for f in "$dir/slurmd.pid" "$dir/slurmctld.pid"; do
        [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null || true
    done
}

case ${1:-} in
    up) [ $# -eq 2 ] || die "usage: up DIR"; up "$2" ;;
    down) [ $# -eq 2 ] || die "usage: down DIR"; down "$2" ;;
    *) sed -n '2,10p' "$0"; exit 2 ;;
esac
