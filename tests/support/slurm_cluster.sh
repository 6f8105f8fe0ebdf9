#!/usr/bin/env bash
# A real Slurm 22.05 cluster of two nodes (node1, node2) on this one machine, for the slurm-marked tests.
#
#   bash tests/support/slurm_cluster.sh start    # install the Debian packages if missing, start munged,
#                                                # slurmctld and one slurmd per node; idempotent
#   bash tests/support/slurm_cluster.sh stop     # cancel the jobs, stop every daemon this script started
#   bash tests/support/slurm_cluster.sh status   # exit 0 when the controller and both nodes answer
#
# Needs root (it writes /etc/slurm/slurm.conf and runs the daemons). Each node is a slurmd started with
# -N nodeK on its own port (Debian builds Slurm with multiple-slurmd support); both reach the controller
# over 127.0.0.1 and have CPUS_PER_NODE CPUs (default 4, above the real count: config_overrides). There is
# no systemd: the daemons fork and write pid files under SLURM_CLUSTER_DIR (default /tmp/megatron-rl-slurm),
# and stop kills only those pids. Each setting below says why it is there.
set -euo pipefail

DIR=${SLURM_CLUSTER_DIR:-/tmp/megatron-rl-slurm}
CPUS=${CPUS_PER_NODE:-4}
NODES=(node1 node2)
PORTS=(6818 6819)
CONF=/etc/slurm/slurm.conf
PACKAGES=(slurmctld slurmd slurm-client munge)

log() { echo "slurm_cluster: $*" >&2; }
die() {
  log "error: $*"
  exit 1
}

# A pid from a pid file that is alive, not a zombie, and runs the named program.
live_pid() {
  local file=$1 comm=$2 pid state
  [[ -s $file ]] || return 1
  pid=$(tr -dc '0-9' <"$file")
  [[ -n $pid && -r /proc/$pid/stat ]] || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$comm" ]] || return 1
  state=$(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null)
  [[ $state != Z ]] || return 1
  echo "$pid"
}

install_packages() {
  local missing=()
  for pkg in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || missing+=("$pkg")
  done
  ((${#missing[@]} == 0)) && return 0
  [[ $(id -u) == 0 ]] || die "the Slurm packages (${missing[*]}) are missing and installing them needs root"
  command -v apt-get >/dev/null || die "the Slurm packages (${missing[*]}) are missing and apt-get is not available"
  log "installing ${missing[*]}"
  apt-get update -qq >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >/dev/null
}

write_config() {
  mkdir -p "$DIR"/{state,run,log} /etc/slurm
  local node
  for node in "${NODES[@]}"; do mkdir -p "$DIR/spool/$node"; done
  local tmp=$CONF.tmp.$$
  cat >"$tmp" <<EOF
# Written by tests/support/slurm_cluster.sh: a two-node test cluster on one machine.
ClusterName=megatron-rl-test
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
AuthType=auth/munge
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerParameters=batch_sched_delay=0,bf_interval=1
SlurmdParameters=config_overrides
EnforcePartLimits=ALL
ReturnToService=2
MailProg=/bin/true
MinJobAge=120
KillWait=10
StateSaveLocation=$DIR/state
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdSpoolDir=$DIR/spool/%n
SlurmdPidFile=$DIR/run/slurmd-%n.pid
SlurmdLogFile=$DIR/log/slurmd-%n.log
EOF
  local i
  for i in "${!NODES[@]}"; do
    echo "NodeName=${NODES[$i]} NodeHostname=localhost NodeAddr=127.0.0.1 Port=${PORTS[$i]} CPUs=$CPUS RealMemory=4000" >>"$tmp"
  done
  echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$tmp"
  if [[ -f $CONF ]] && cmp -s "$tmp" "$CONF"; then
    rm -f "$tmp"
    return 1 # unchanged
  fi
  mv "$tmp" "$CONF"
  return 0
}

start_munge() {
  if live_pid /run/munge/munged.pid munged >/dev/null; then return 0; fi
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  [[ -s /etc/munge/munge.key ]] || die "/etc/munge/munge.key is missing (the munge package creates it)"
  runuser -u munge -- /usr/sbin/munged --force
  local _
  for _ in $(seq 50); do
    munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  die "munged did not start (munge -n | unmunge fails)"
}

controller_up() { timeout 10 scontrol ping 2>/dev/null | grep -q "is UP"; }

nodes_ready() {
  # every node answers: idle, allocated or mixed (not down, drained or not responding)
  local states
  states=$(timeout 10 sinfo -h -N -o "%N %t" 2>/dev/null) || return 1
  local node
  for node in "${NODES[@]}"; do
    grep -Eq "^$node (idle|alloc|mix)$" <<<"$states" || return 1
  done
}

start() {
  install_packages
  local changed=0
  write_config && changed=1
  start_munge
  if ((changed)) && live_pid "$DIR/run/slurmctld.pid" slurmctld >/dev/null; then
    log "slurm.conf changed: restarting the daemons"
    stop_daemons
  fi
  if ! live_pid "$DIR/run/slurmctld.pid" slurmctld >/dev/null; then
    slurmctld -c -i # a controller that is not running left no live jobs: recovering them would hold the nodes
  fi
  local _
  for _ in $(seq 150); do
    controller_up && break
    sleep 0.2
  done
  controller_up || die "slurmctld did not answer 'scontrol ping' (log: $DIR/log/slurmctld.log)"
  local node
  for node in "${NODES[@]}"; do
    live_pid "$DIR/run/slurmd-$node.pid" slurmd >/dev/null || slurmd -N "$node"
  done
  for _ in $(seq 150); do
    nodes_ready && break
    sleep 0.2
  done
  nodes_ready || die "the nodes did not become idle: $(sinfo -h -N -o '%N %t' 2>&1 | tr '\n' ' ') (logs: $DIR/log)"
  log "up: ${NODES[*]} with $CPUS CPUs each"
}

stop_daemons() {
  local files=("$DIR"/run/slurmd-*.pid "$DIR/run/slurmctld.pid")
  local pids=() file pid
  for file in "${files[@]}"; do
    [[ -e $file ]] || continue
    pid=$(live_pid "$file" slurmd || live_pid "$file" slurmctld) || continue
    pids+=("$pid")
    kill -TERM "$pid" 2>/dev/null || true
  done
  local _ alive
  for _ in $(seq 100); do
    alive=()
    for pid in "${pids[@]}"; do
      [[ -r /proc/$pid/stat && $(awk '{print $3}' "/proc/$pid/stat" 2>/dev/null) != Z ]] && alive+=("$pid")
    done
    ((${#alive[@]} == 0)) && break
    sleep 0.1
  done
  for pid in "${alive[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  rm -f "$DIR"/run/*.pid
}

# Jobs outlive slurmd (their slurmstepd runs on): cancel them first, and wait until they are gone.
cancel_jobs() {
  [[ -f $CONF ]] && controller_up || return 0
  local jobs _
  jobs=$(squeue -h -o %i 2>/dev/null | tr '\n' ' ')
  [[ -n ${jobs// /} ]] || return 0
  log "cancelling jobs $jobs"
  # shellcheck disable=SC2086
  scancel $jobs 2>/dev/null || true
  for _ in $(seq 150); do
    [[ -z $(squeue -h -o %i 2>/dev/null) ]] && return 0
    sleep 0.2
  done
  log "jobs still listed after 30 s: $(squeue -h -o '%i %T' 2>/dev/null | tr '\n' ' ')"
}

stop() {
  cancel_jobs
  stop_daemons
  pid=$(live_pid /run/munge/munged.pid munged) && kill -TERM "$pid" 2>/dev/null || true
  log "stopped"
}

status() {
  [[ -f $CONF ]] || die "no $CONF: the cluster was never started"
  controller_up || die "slurmctld does not answer"
  nodes_ready || die "nodes not ready: $(sinfo -h -N -o '%N %t' 2>&1 | tr '\n' ' ')"
  log "up"
}

case "${1:-}" in
start) start ;;
stop) stop ;;
status) status ;;
*)
  echo "usage: $0 start|stop|status" >&2
  exit 2
  ;;
esac
