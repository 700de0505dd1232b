#!/usr/bin/env bash
# A real SLURM cluster on this one machine for tests and local experiments (Debian slurm-wlm + munge), no
# systemd: one node (the machine itself), or N compute nodes, each its own slurmd in its own network namespace.
#
#   infra/slurm/local_cluster.sh start    # idempotent: munge key + munged, slurm.conf, slurmctld, slurmd(s); waits for idle
#   infra/slurm/local_cluster.sh stop     # stops slurmd(s) + slurmctld (and munged if this script started it)
#   infra/slurm/local_cluster.sh status   # exit 0 when the cluster answers and every node is usable
#   infra/slurm/local_cluster.sh env      # prints `export SLURM_CONF=...` (eval it before sinfo/srun/sbatch)
#   infra/slurm/local_cluster.sh kill-node NODE   # multi-node: SIGKILL everything on NODE (a node that dies)
#   infra/slurm/local_cluster.sh exec NODE CMD... # multi-node: run CMD on NODE (its namespaces, as slurmd does)
#
# Multi-node (TCNN_SLURM_NODES=N > 1): nodes node1..nodeN, each a network namespace <netns>-nodeI with its own
# address <net>.(10+I) on a bridge <netns>-br (<net>.1, this host, where slurmctld listens), its own hostname
# (a UTS namespace) and /etc/hosts (a bind mount of $TCNN_SLURM_DIR/net/nodeI.hosts: every node and the controller),
# its own slurmd (spool, log and pid file named after the node), advertising its share of the CPUs and memory.
# The test network exists only on this machine (no route out, no forwarding). The filesystem is shared, as a
# cluster's shared filesystem is. `start` after `kill-node` brings the dead node back (a reboot).
#
# Settings (environment):
#   TCNN_SLURM_DIR        state directory (slurm.conf, spool, state, logs, pid files)  [/tmp/tcnn-slurm]
#   TCNN_SLURM_CTLD_PORT  slurmctld port [6817]      TCNN_SLURM_SLURMD_PORT  slurmd port [6818]
#   TCNN_SLURM_TIMEOUT    seconds to wait for the node(s) to become idle [60]
#   TCNN_SLURM_NODES      compute nodes [1]; >1: the network-namespace nodes above
#   TCNN_SLURM_CPUS_PER_NODE  CPUs each node advertises [the machine's CPUs / nodes, at least 1]
#   TCNN_SLURM_NET        the test network's /24 prefix [10.77.0]
#   TCNN_SLURM_NETNS      prefix of the namespace and link names, at most 8 characters [tcnn]
#   TCNN_SLURM_SLURMD_TIMEOUT  seconds without an answer before slurmctld marks a node DOWN [60; multi-node 20]
# The daemons run as root (start needs root); clients only need SLURM_CONF=$TCNN_SLURM_DIR/slurm.conf.
# Daemons get no inherited descriptors (lock, caller's pipes), so callers capturing output never hang.
# There is no accounting database: sacct fails, which submitit tolerates (it falls back to squeue).
set -euo pipefail

DIR=${TCNN_SLURM_DIR:-/tmp/tcnn-slurm}
CTLD_PORT=${TCNN_SLURM_CTLD_PORT:-6817}
SLURMD_PORT=${TCNN_SLURM_SLURMD_PORT:-6818}
TIMEOUT=${TCNN_SLURM_TIMEOUT:-60}
NODES=${TCNN_SLURM_NODES:-1}
NODES_GIVEN=${TCNN_SLURM_NODES:-}
NET=${TCNN_SLURM_NET:-10.77.0}
NETNS=${TCNN_SLURM_NETNS:-tcnn}
SLURMD_TIMEOUT=${TCNN_SLURM_SLURMD_TIMEOUT:-}
CONF="$DIR/slurm.conf"
export SLURM_CONF="$CONF"
MUNGE_SOCKET=/run/munge/munge.socket.2

log() { echo "local_cluster: $*" >&2; }
die() {
  echo "local_cluster: error: $*" >&2
  exit "${2:-1}"
}

have() { command -v "$1" >/dev/null 2>&1; }
pid_alive() { [ -f "$1" ] && kill -0 "$(cat "$1" 2>/dev/null)" 2>/dev/null; }

# A dead munged leaves its socket behind and the munge client then retries for about a minute: check the pid first.
munge_ok() {
  [ -S "$MUNGE_SOCKET" ] && pid_alive "$(dirname "$MUNGE_SOCKET")/munged.pid" &&
    munge -n -S "$MUNGE_SOCKET" 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1
}

# Without a slurm.conf the clients go "configless" and wait on DNS SRV lookups for a minute: check the file first.
ctld_ok() { [ -f "$CONF" ] && scontrol ping 2>/dev/null | grep -q "is UP"; }

multi() { [ "$NODES" -gt 1 ]; }
node_names() { if multi; then for i in $(seq 1 "$NODES"); do echo "node$i"; done; else hostname -s; fi; }
node_index() {
  local n=${1#node}
  [[ "$n" =~ ^[0-9]+$ ]] && [ "$n" -ge 1 ] && [ "$n" -le "$NODES" ] || die "no node '$1' (node1..node$NODES)"
  echo "$n"
}
node_ns() { echo "$NETNS-$1"; }
hosts_file() { echo "$DIR/net/$1.hosts"; }
node_addr() { echo "$NET.$((10 + $(node_index "$1")))"; }
slurmd_pidfile() { if multi; then echo "$DIR/run/slurmd-$1.pid"; else echo "$DIR/run/slurmd.pid"; fi; }
slurmd_timeout() { if [ -n "$SLURMD_TIMEOUT" ]; then echo "$SLURMD_TIMEOUT"; elif multi; then echo 20; else echo 60; fi; }
# A setting the configured cluster was started with (the marker line in its slurm.conf): nodes, net, netns.
conf_setting() { sed -n "s/^# tcnn-cluster: .*\b$1=\([^ ]*\).*/\1/p" "$CONF" 2>/dev/null || true; }

# "NAME STATE" per node
node_states() { sinfo -h -N -o '%N %T' 2>/dev/null | sort -u; }
not_usable() { awk '$2 !~ /^(idle|mixed|allocated|completing)$/' <<<"$1"; }

check_settings() {
  [[ "$NODES" =~ ^[0-9]+$ ]] && [ "$NODES" -ge 1 ] && [ "$NODES" -le 200 ] ||
    die "TCNN_SLURM_NODES: expected 1..200, got '$NODES'"
  if multi; then
    [[ "$NET" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] ||
      die "TCNN_SLURM_NET: expected a /24 prefix like 10.77.0, got '$NET'"
    [[ "$NETNS" =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "TCNN_SLURM_NETNS: 1-8 lower-case letters/digits, got '$NETNS'"
    have ip && have unshare && have nsenter || die "a multi-node cluster needs iproute2 (ip) and util-linux (unshare, nsenter)" 3
  fi
}

ensure_munge() {
  if munge_ok; then return 0; fi
  local key=/etc/munge/munge.key
  if [ ! -s "$key" ]; then
    log "creating munge key $key"
    install -d -m 0700 /etc/munge
    if have mungekey; then mungekey --create --keyfile="$key" --force; else
      dd if=/dev/urandom of="$key" bs=1 count=1024 status=none
    fi
  fi
  local -a run_as=()
  if id munge >/dev/null 2>&1; then
    chown munge:munge /etc/munge "$key"
    chmod 0700 /etc/munge
    chmod 0400 "$key"
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/log/munge
    install -d -o munge -g munge -m 0711 /var/lib/munge
    run_as=(runuser -u munge --)
  else
    install -d -m 0755 /run/munge /var/lib/munge
    install -d -m 0700 /var/log/munge
    run_as=()
  fi
  log "starting munged"
  "${run_as[@]}" /usr/sbin/munged --force 9>&- </dev/null >>"$DIR/log/munged.out" 2>&1
  touch "$DIR/run/munged.started-by-us"
  for _ in $(seq 1 50); do munge_ok && return 0; sleep 0.1; done
  die "munged did not answer on $MUNGE_SOCKET (see /var/log/munge/munged.log)"
}

# ---- the test network (multi-node): a bridge on this host; per node a namespace, a veth pair, a hosts file

netns_exists() { ip netns list 2>/dev/null | awk '{print $1}' | grep -qx "$1"; }

ensure_net() {
  local br="$NETNS-br" node ns veth hosts
  if ! ip link show "$br" >/dev/null 2>&1; then
    log "creating bridge $br ($NET.1/24)"
    ip link add "$br" type bridge
    ip addr add "$NET.1/24" dev "$br"
  fi
  ip link set "$br" up
  hosts=$(printf '127.0.0.1 localhost\n::1 localhost\n%s %s' "$NET.1" "$(hostname -s)")
  for node in $(node_names); do hosts+=$(printf '\n%s %s' "$(node_addr "$node")" "$node"); done
  for node in $(node_names); do
    ns=$(node_ns "$node")
    veth="$NETNS-v$(node_index "$node")"
    mkdir -p "$DIR/net"
    printf '%s\n' "$hosts" >"$(hosts_file "$node")" # the node's /etc/hosts (on_node)
    netns_exists "$ns" || ip netns add "$ns"
    if ! ip link show "$veth" >/dev/null 2>&1; then
      ip link add "$veth" type veth peer name eth0 netns "$ns"
      ip link set "$veth" master "$br"
      ip -n "$ns" addr add "$(node_addr "$node")/24" dev eth0
    fi
    ip link set "$veth" up
    ip -n "$ns" link set lo up
    ip -n "$ns" link set eth0 up
  done
}

remove_net() {
  local node ns pids
  for node in $(node_names); do
    ns=$(node_ns "$node")
    if netns_exists "$ns"; then
      pids=$(ip netns pids "$ns" 2>/dev/null || true)
      # shellcheck disable=SC2086
      [ -z "$pids" ] || kill -KILL $pids 2>/dev/null || true
      ip netns del "$ns" 2>/dev/null || true
    fi
    ip link del "$NETNS-v$(node_index "$node")" 2>/dev/null || true
  done
  ip link del "$NETNS-br" 2>/dev/null || true
}

# Run a command on a node: its network namespace, and its own UTS and mount namespaces for its hostname and
# /etc/hosts (a bind mount). Not `ip netns exec`: that remounts /sys, hiding the cgroup tree slurmd needs.
on_node() {
  local node=$1
  shift
  nsenter --net="/run/netns/$(node_ns "$node")" unshare --uts --mount --propagation private /bin/sh -c \
    'mount --bind "$1" /etc/hosts && hostname "$0" && shift && exec "$@"' "$node" "$(hosts_file "$node")" "$@"
}

write_conf() {
  local node_line host mem cpus node ctld_host=localhost
  local spool=$DIR/spool slurmd_pid=$DIR/run/slurmd.pid slurmd_log=$DIR/log/slurmd.log
  host=$(hostname -s)
  # `slurmd -C` prints the node's real layout: "NodeName=vm CPUs=2 Boards=1 ... RealMemory=24105"
  node_line=$(slurmd -C | head -n1)
  node_line=${node_line/NodeName=* CPUs=/CPUs=}
  mem=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$node_line")
  [ -n "$mem" ] || die "could not read RealMemory from 'slurmd -C'"
  if multi; then
    cpus=${TCNN_SLURM_CPUS_PER_NODE:-$(($(nproc) / NODES))}
    [ "$cpus" -ge 1 ] || cpus=1
    ctld_host="$host($NET.1)"
    spool="$DIR/spool/%n" slurmd_pid="$DIR/run/slurmd-%n.pid" slurmd_log="$DIR/log/slurmd-%n.log"
  fi
  local tmp="$CONF.tmp.$$"
  cat >"$tmp" <<EOF
# Generated by infra/slurm/local_cluster.sh — a test cluster on one machine. Do not edit; re-run start.
# tcnn-cluster: nodes=$NODES net=$NET netns=$NETNS
ClusterName=tcnn
SlurmctldHost=$ctld_host
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$spool
SlurmctldPidFile=$DIR/run/slurmctld.pid
SlurmdPidFile=$slurmd_pid
SlurmctldLogFile=$DIR/log/slurmctld.log
SlurmdLogFile=$slurmd_log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=none
ReturnToService=2
JobRequeue=1
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
# Quick signals/requeue for tests; completed jobs stay visible to squeue for 10 min (submitit polls it).
KillWait=5
MinJobAge=600
# Job ids of different test clusters on this machine never meet (a job's Ray temp dir is /tmp/tcnn-ray-<jobid>).
FirstJobId=$(multi && echo $((NODES * 100000)) || echo 1)
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=$(slurmd_timeout)
MessageTimeout=20
EOF
  if multi; then
    {
      echo "# Each node advertises its share of this machine (the configured values count: config_overrides)."
      echo "SlurmdParameters=config_overrides"
      for node in $(node_names); do
        echo "NodeName=$node NodeAddr=$(node_addr "$node") CPUs=$cpus RealMemory=$((mem / NODES)) State=UNKNOWN"
      done
      echo "PartitionName=debug Nodes=node[1-$NODES] Default=YES MaxTime=INFINITE State=UP"
    } >>"$tmp"
  else
    {
      echo "NodeName=$host NodeAddr=127.0.0.1 $node_line State=UNKNOWN"
      echo "PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP"
    } >>"$tmp"
  fi
  mv -f "$tmp" "$CONF"
}

# Every node idle (or busy); a down/drained node is resumed (one that came back after kill-node).
wait_idle() {
  local deadline=$((SECONDS + TIMEOUT)) states bad name state
  while [ $SECONDS -lt $deadline ]; do
    states=$(node_states || true)
    bad=$(not_usable "$states")
    if [ -n "$states" ] && [ -z "$bad" ] && [ "$(wc -l <<<"$states")" -ge "$NODES" ]; then return 0; fi
    while read -r name state; do
      case "$state" in
        drain* | down* | fail*) scontrol update NodeName="$name" State=RESUME >/dev/null 2>&1 || true ;;
      esac
    done <<<"$bad"
    sleep 0.5
  done
  die "not every node is idle after ${TIMEOUT}s ($(tr '\n' ' ' <<<"${states:-none}")); logs in $DIR/log"
}

all_slurmd_alive() {
  local node
  for node in $(node_names); do pid_alive "$(slurmd_pidfile "$node")" || return 1; done
}

start_slurmd() {
  local node=$1
  if multi; then
    mkdir -p "$DIR/spool/$node"
    log "starting slurmd on $node ($(node_addr "$node"), namespace $(node_ns "$node"))"
    on_node "$node" slurmd -f "$CONF" -N "$node" 9>&- </dev/null >>"$DIR/log/slurmd-$node.out" 2>&1 ||
      die "slurmd on $node failed; see $DIR/log/slurmd-$node.log"
  else
    log "starting slurmd"
    slurmd -f "$CONF" 9>&- </dev/null >>"$DIR/log/slurmd.out" 2>&1 || die "slurmd failed; see $DIR/log/slurmd.log"
  fi
}

start() {
  have slurmctld && have slurmd && have sinfo || die "slurm-wlm is not installed (apt-get install slurm-wlm munge)" 3
  check_settings
  mkdir -p "$DIR"
  exec 9>"$DIR/.lock"
  flock 9
  if ctld_ok; then
    local running
    running=$(conf_setting nodes)
    [ -n "$NODES_GIVEN" ] || NODES=${running:-1} # unset: whatever runs (e.g. `start` to bring a node back)
    [ "${running:-1}" = "$NODES" ] ||
      die "the cluster in $DIR runs ${running:-1} node(s), not $NODES: stop it first (or use another TCNN_SLURM_DIR)"
    use_running_nodes # its network, whatever the environment says now (a node brought back after kill-node)
    if all_slurmd_alive; then
      wait_idle
      log "already running (SLURM_CONF=$CONF)"
      return 0
    fi
  fi
  [ "$(id -u)" = 0 ] || die "starting the cluster needs root (the daemons run as root)" 3
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/run" "$DIR/log"
  ensure_munge
  if multi; then ensure_net; fi
  if ! pid_alive "$DIR/run/slurmctld.pid"; then write_conf; fi
  if ! pid_alive "$DIR/run/slurmctld.pid"; then
    log "starting slurmctld"
    slurmctld -f "$CONF" 9>&- </dev/null >>"$DIR/log/slurmctld.out" 2>&1 || die "slurmctld failed; see $DIR/log/slurmctld.log"
  fi
  for _ in $(seq 1 100); do ctld_ok && break; sleep 0.2; done
  ctld_ok || die "slurmctld does not answer; see $DIR/log/slurmctld.log"
  local node
  for node in $(node_names); do
    pid_alive "$(slurmd_pidfile "$node")" || start_slurmd "$node"
  done
  wait_idle
  log "up: $(sinfo -h -o '%P %a %D %T' | head -n1) (SLURM_CONF=$CONF)"
}

stop_pid() {
  local pidfile=$1 name=$2
  if pid_alive "$pidfile"; then
    local pid
    pid=$(cat "$pidfile")
    log "stopping $name (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.2; done
    kill -0 "$pid" 2>/dev/null && kill -KILL "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}

# The layout of the cluster configured in $DIR (whatever TCNN_SLURM_NODES/NET/NETNS say now).
use_running_nodes() {
  local value
  value=$(conf_setting nodes) && NODES=${value:-$NODES}
  value=$(conf_setting net) && NET=${value:-$NET}
  value=$(conf_setting netns) && NETNS=${value:-$NETNS}
}

stop() {
  [ -d "$DIR" ] || return 0
  exec 9>"$DIR/.lock"
  flock 9
  use_running_nodes
  local node
  for node in $(node_names); do stop_pid "$(slurmd_pidfile "$node")" "slurmd on $node"; done
  stop_pid "$DIR/run/slurmctld.pid" slurmctld
  if multi; then remove_net; fi # kills what jobs left on the nodes, then removes the namespaces and links
  if [ -f "$DIR/run/munged.started-by-us" ]; then
    log "stopping munged"
    /usr/sbin/munged --stop >/dev/null 2>&1 || true
    rm -f "$DIR/run/munged.started-by-us"
  fi
}

status() {
  [ -f "$CONF" ] || die "no cluster configured in $DIR" 1
  ctld_ok || die "slurmctld does not answer" 1
  local states
  states=$(node_states || true)
  [ -n "$states" ] && [ -z "$(not_usable "$states")" ] || die "node state: $(tr '\n' ' ' <<<"${states:-unknown}")" 1
  if [ "$(wc -l <<<"$states")" -gt 1 ]; then
    echo "up: $(wc -l <<<"$states") nodes: $(tr '\n' ' ' <<<"$states")(SLURM_CONF=$CONF)"
  else
    echo "up: node ${states#* } (SLURM_CONF=$CONF)"
  fi
}

# A node that dies: SIGKILL to every process in its network namespace (slurmd, slurmstepd, the job's tasks,
# Ray's raylet and workers) at once. slurmctld marks it DOWN after SlurmdTimeout; `start` brings it back.
kill_node() {
  local node=${1:-} ns pids
  use_running_nodes
  multi || die "kill-node: the cluster in $DIR has one node (TCNN_SLURM_NODES > 1 makes namespace nodes)"
  [ -n "$node" ] || die "usage: $0 kill-node NODE"
  node_index "$node" >/dev/null
  ns=$(node_ns "$node")
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  [ -n "$pids" ] || die "kill-node: nothing runs on $node"
  log "killing $node: $(wc -w <<<"$pids") process(es)"
  # Until nothing is left: a process forked between the listing and the kill (a job step, a Ray worker) would
  # outlive a single pass, which a dead node's processes do not.
  local pass=0
  while [ -n "$pids" ] && [ "$pass" -lt 50 ]; do
    # shellcheck disable=SC2086
    kill -KILL $pids 2>/dev/null || true
    sleep 0.1
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    pass=$((pass + 1))
  done
  [ -z "$pids" ] || die "kill-node: processes $(tr '\n' ' ' <<<"$pids")on $node outlived 50 SIGKILLs"
}

exec_on() {
  local node=${1:-}
  use_running_nodes
  multi || die "exec: the cluster in $DIR has one node"
  [ -n "$node" ] && [ "$#" -ge 2 ] || die "usage: $0 exec NODE CMD..."
  node_index "$node" >/dev/null
  shift
  on_node "$node" "$@"
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  restart) stop && start ;;
  status) status ;;
  env) echo "export SLURM_CONF=$CONF" ;;
  kill-node) kill_node "${2:-}" ;;
  exec) shift && exec_on "$@" ;;
  *)
    echo "usage: $0 start|stop|restart|status|env|kill-node NODE|exec NODE CMD..." >&2
    exit 2
    ;;
esac
