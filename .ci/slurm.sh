#!/usr/bin/env bash
# A one-node Slurm cluster on this machine, for tests/slurm: Debian's slurm-wlm and munge, a controller and a node
# daemon on loopback, state under $SLURM_STATE (default /tmp/lightning_resilience_slurm). Idempotent: a cluster it
# started before is stopped and started again. Writes $SLURM_STATE/ready (the slurm.conf path) when `sinfo` answers,
# or $SLURM_STATE/skip with the reason when Slurm cannot be installed or started here (the tests then skip, saying
# why). Usage: .ci/slurm.sh [start|stop]
set -uo pipefail
STATE=${SLURM_STATE:-/tmp/lightning_resilience_slurm}
CONF=$STATE/slurm.conf
mkdir -p "$STATE"
rm -f "$STATE/ready" "$STATE/skip"

skip() { echo "$1" > "$STATE/skip"; echo "slurm: skipped: $1" >&2; exit 0; }

stop() {
  for d in slurmd slurmctld munged; do
    if [ -f "$STATE/$d.pid" ]; then kill "$(cat "$STATE/$d.pid")" 2>/dev/null; rm -f "$STATE/$d.pid"; fi
  done
  sleep 1
}

if [ "${1:-start}" = stop ]; then stop; exit 0; fi

if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    skip "slurm-wlm and munge are not installed and cannot be (needs root and apt-get)"
  fi
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge) >"$STATE/apt.log" 2>&1 \
    || skip "apt-get install slurm-wlm munge failed (see $STATE/apt.log)"
fi
stop

# munge: a key of our own, its socket in our state folder
mkdir -p "$STATE/munge" && chmod 700 "$STATE/munge"
[ -f "$STATE/munge/munge.key" ] || dd if=/dev/urandom of="$STATE/munge/munge.key" bs=1024 count=1 2>/dev/null
chmod 400 "$STATE/munge/munge.key"
MUNGE_SOCKET=$STATE/munge/munge.socket
munged --force --key-file="$STATE/munge/munge.key" --socket="$MUNGE_SOCKET" --pid-file="$STATE/munged.pid" \
  --log-file="$STATE/munged.log" --seed-file="$STATE/munge/seed" 2>>"$STATE/munged.log" \
  || skip "munged did not start (see $STATE/munged.log)"

NODE=$(hostname -s)
CPUS=$(nproc)
MEM=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
mkdir -p "$STATE/ctld" "$STATE/d"
cat > "$CONF" <<CONFEOF
ClusterName=lrtest
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$MUNGE_SOCKET
CredType=cred/munge
StateSaveLocation=$STATE/ctld
SlurmdSpoolDir=$STATE/d
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
SlurmctldPort=${SLURMCTLD_PORT:-6817}
SlurmdPort=${SLURMD_PORT:-6818}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SwitchType=switch/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobRequeue=1
KillWait=30
MinJobAge=600
SlurmctldTimeout=30
SlurmdTimeout=60
NodeName=$NODE NodeAddr=127.0.0.1 CPUs=$CPUS RealMemory=$MEM State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONFEOF
export SLURM_CONF=$CONF
slurmctld -f "$CONF" >>"$STATE/slurmctld.log" 2>&1 || skip "slurmctld did not start (see $STATE/slurmctld.log)"
slurmd -f "$CONF" >>"$STATE/slurmd.log" 2>&1 || skip "slurmd did not start (see $STATE/slurmd.log)"
for _ in $(seq 1 30); do
  if sinfo -h -o %t 2>/dev/null | grep -qE '^(idle|mix|alloc)'; then
    echo "$CONF" > "$STATE/ready"
    echo "slurm: one-node cluster up ($CONF)" >&2
    exit 0
  fi
  scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1
  sleep 1
done
skip "the node did not come up within 30 s (see $STATE/slurmctld.log, $STATE/slurmd.log)"
