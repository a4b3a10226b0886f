#!/usr/bin/env bash
# A real Slurm on this host for tests/slurm: slurmctld plus one slurmd per fake
# node (n1..nN, all on this host, told apart by SLURMD_NODENAME), fake GPUs
# through GRES (character device nodes, so CUDA_VISIBLE_DEVICES is set per
# task), preemption that signals (preempt_send_user_signal + GraceTime) and
# requeues, and DefMemPerCPU so jobs do not take a whole node's memory.
# See ../shared/SLURM-FACTS.md-style notes in docs/slurm.md.
#
# Idempotent: installs if missing, rewrites the config and reconfigures only
# when it changed, starts only the daemons that are not running, then waits
# for every node to be idle. Root only. Debian 12 and 13.
#
# Knobs (environment): PRORL_SLURM_NODES (3), PRORL_SLURM_GPUS (2 per node),
# PRORL_SLURM_PROCTRACK (cgroup when cgroup v1 is mounted, else linuxproc),
# PRORL_SLURM_EXTRA_CONF (extra slurm.conf lines).
#
# Jobs run as the submitting user. The tests submit as root and use the
# interpreter that runs them; jobs for other users need a world-readable
# Python (a venv built from /usr/bin/python3), not root's pyenv.
set -euo pipefail
. /etc/os-release
export DEBIAN_FRONTEND=noninteractive
if [ "$(id -u)" != 0 ]; then
  echo "50-slurm.sh: must run as root" >&2
  exit 1
fi
case "${VERSION_ID:-}" in
  12|13) ;;
  *) echo "50-slurm.sh: tested on Debian 12 and 13, this is ${PRETTY_NAME:-unknown}; trying anyway" >&2 ;;
esac

NODES=${PRORL_SLURM_NODES:-3}
GPUS=${PRORL_SLURM_GPUS:-2}
HOST=$(hostname -s)
CONF_DIR=/etc/slurm
GPU_DIR=/var/lib/prorl-fakegpu
SPOOL=/var/spool/slurm
if [ -z "${PRORL_SLURM_PROCTRACK:-}" ]; then
  if [ -d /sys/fs/cgroup/freezer ]; then PRORL_SLURM_PROCTRACK=cgroup; else PRORL_SLURM_PROCTRACK=linuxproc; fi
fi

if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
  apt-get -o DPkg::Lock::Timeout=900 install -y --no-install-recommends slurm-wlm munge
fi

mkdir -p "$CONF_DIR" "$SPOOL/ctld" /var/log/slurm "$GPU_DIR"
# Fake GPUs must be character devices (regular files leave CUDA_VISIBLE_DEVICES unset).
for i in $(seq 0 $((GPUS - 1))); do
  [ -c "$GPU_DIR/fakegpu$i" ] || { rm -f "$GPU_DIR/fakegpu$i"; mknod -m 666 "$GPU_DIR/fakegpu$i" c 1 3; }
done
MEM_MB=$(awk '/MemTotal/ {print int($2 / 1024 / 3)}' /proc/meminfo)
CPUS=$(nproc)

conf=$(mktemp)
{
  echo "# written by prorl scripts/provision/50-slurm.sh"
  echo "ClusterName=prorl"
  echo "SlurmctldHost=$HOST"
  echo "SlurmUser=root"
  echo "SlurmdUser=root"
  echo "AuthType=auth/munge"
  echo "CredType=cred/munge"
  echo "MpiDefault=none"
  echo "ProctrackType=proctrack/$PRORL_SLURM_PROCTRACK"
  echo "TaskPlugin=task/none"
  echo "SelectType=select/cons_tres"
  echo "SelectTypeParameters=CR_Core_Memory"
  echo "DefMemPerCPU=512"
  echo "JobAcctGatherType=jobacct_gather/none"
  echo "AccountingStorageType=accounting_storage/none"
  echo "ReturnToService=2"
  echo "MinJobAge=60"
  echo "KillWait=15"
  echo "SlurmctldPidFile=/run/slurmctld.pid"
  echo "SlurmdPidFile=/run/slurmd-%n.pid"
  echo "SlurmdSpoolDir=$SPOOL/d-%n"
  echo "StateSaveLocation=$SPOOL/ctld"
  echo "SlurmctldLogFile=/var/log/slurm/slurmctld.log"
  echo "SlurmdLogFile=/var/log/slurm/slurmd-%n.log"
  echo "PreemptType=preempt/partition_prio"
  echo "PreemptMode=REQUEUE"
  echo "SlurmctldParameters=preempt_send_user_signal"
  echo "GresTypes=gpu"
  for n in $(seq 1 "$NODES"); do
    echo "NodeName=n$n NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((17000 + n)) CPUs=$CPUS RealMemory=$MEM_MB Gres=gpu:$GPUS"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES OverSubscribe=FORCE:8 State=UP"
  echo "PartitionName=spread Nodes=ALL OverSubscribe=EXCLUSIVE State=UP"
  echo "PartitionName=low Nodes=n1 PriorityTier=1 OverSubscribe=NO GraceTime=20 State=UP"
  echo "PartitionName=high Nodes=n1 PriorityTier=10 OverSubscribe=NO State=UP"
  [ -z "${PRORL_SLURM_EXTRA_CONF:-}" ] || echo "$PRORL_SLURM_EXTRA_CONF"
} >"$conf"
gres=$(mktemp)
{
  echo "AutoDetect=off"
  if [ "$GPUS" -gt 1 ]; then echo "Name=gpu File=$GPU_DIR/fakegpu[0-$((GPUS - 1))]"; else echo "Name=gpu File=$GPU_DIR/fakegpu0"; fi
} >"$gres"
cgroup=$(mktemp)
printf '%s\n' "CgroupPlugin=cgroup/v1" "CgroupMountpoint=/sys/fs/cgroup" "ConstrainCores=no" "ConstrainRAMSpace=no" "ConstrainDevices=no" >"$cgroup"

changed=0
install_if_changed() {  # new dest
  if ! cmp -s "$1" "$2"; then install -m 0644 "$1" "$2"; changed=1; fi
  rm -f "$1"
}
install_if_changed "$conf" "$CONF_DIR/slurm.conf"
install_if_changed "$gres" "$CONF_DIR/gres.conf"
install_if_changed "$cgroup" "$CONF_DIR/cgroup.conf"

running() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

# munge: the postinst made the key; start the daemon if it is not up.
if ! munge -n </dev/null >/dev/null 2>&1; then
  mkdir -p /run/munge && chown munge:munge /run/munge 2>/dev/null || true
  runuser -u munge -- /usr/sbin/munged || /usr/sbin/munged --force
fi

if running /run/slurmctld.pid; then
  if [ "$changed" = 1 ]; then scontrol reconfigure; fi
else
  slurmctld
fi
for n in $(seq 1 "$NODES"); do
  mkdir -p "$SPOOL/d-n$n"
  if running "/run/slurmd-n$n.pid"; then
    # slurmd reads gres.conf only at start.
    if [ "$changed" = 1 ]; then
      pid=$(cat "/run/slurmd-n$n.pid")
      kill "$pid"
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
      slurmd -N "n$n"
    fi
  else
    slurmd -N "n$n"
  fi
done

# Wait until every node is idle (or at least up and schedulable).
for _ in $(seq 1 60); do
  states=$(sinfo -h -N -p debug -o '%N %t' 2>/dev/null | sort -u || true)
  if [ -n "$states" ] && ! echo "$states" | grep -Evq ' (idle|mix|alloc)$'; then
    echo "slurm ready: $(echo "$states" | tr '\n' ' ')"
    exit 0
  fi
  # Nodes that were down from an earlier boot come back here.
  for n in $(seq 1 "$NODES"); do scontrol update NodeName="n$n" State=RESUME >/dev/null 2>&1 || true; done
  sleep 1
done
echo "50-slurm.sh: nodes not idle after 60 s:" >&2
sinfo -N >&2 || true
exit 1
