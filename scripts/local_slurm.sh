#!/usr/bin/env bash
# A one-node SLURM cluster of this machine, for tests/test_multinode.py and for trying sbatch scripts locally.
#
#   bash scripts/local_slurm.sh start DIR    # munged, slurmctld and slurmd with DIR/slurm.conf; then:
#   SLURM_CONF=DIR/slurm.conf srun -n 2 python -m recipes.full_finetune flavor=cpu-2 ...
#   bash scripts/local_slurm.sh stop DIR
#
# Needs Debian's slurm-wlm and munge packages (apt-get install slurm-wlm munge) and root. Everything it writes
# (configuration, state, logs, pid files) is under DIR; munge's key is the package's (/etc/munge/munge.key).
set -euo pipefail
action=${1:?start or stop}
dir=$(realpath -m "${2:?a folder for the configuration, state and logs}")

stop() {
    for pidfile in "$dir/slurmd.pid" "$dir/slurmctld.pid"; do
        [ -f "$pidfile" ] && kill "$(cat "$pidfile")" 2>/dev/null || true
    done
    sleep 1
}

if [ "$action" = stop ]; then stop; exit 0; fi
[ "$action" = start ] || { echo "usage: $0 start|stop DIR" >&2; exit 2; }
command -v slurmctld >/dev/null || { echo "slurmctld not found: apt-get install slurm-wlm munge" >&2; exit 1; }

mkdir -p "$dir/state" "$dir/spool"
host=$(hostname -s)
cpus=$(nproc)
memory=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat > "$dir/slurm.conf" <<CONF
ClusterName=moai-local
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
NodeName=$host NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF="$dir/slurm.conf"

# munge authenticates SLURM's messages; one daemon serves the machine.
if ! pgrep -x munged >/dev/null; then
    mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
    if [ ! -f /etc/munge/munge.key ]; then
        (command -v mungekey >/dev/null && mungekey --create) || create-munge-key -f
    fi
    (service munge start || su -s /bin/sh munge -c munged || munged --force) >/dev/null 2>&1
fi
slurmctld -f "$SLURM_CONF"
slurmd -f "$SLURM_CONF"
for _ in $(seq 60); do
    if sinfo -h -o %T 2>/dev/null | grep -qx idle; then echo "SLURM is up: SLURM_CONF=$SLURM_CONF"; exit 0; fi
    sleep 1
done
echo "the node did not become idle; see $dir/slurmctld.log and $dir/slurmd.log:" >&2
tail -n 5 "$dir/slurmctld.log" "$dir/slurmd.log" >&2 || true
stop
exit 1
