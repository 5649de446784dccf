#!/usr/bin/env bash
# A Slurm cluster on this machine, to try the batch scripts here and for the tests (tests/test_slurm.py).
# Needs root and the Debian packages: apt-get install -y slurm-wlm munge (and iproute2 for --nodes).
#   bash examples/slurm/local_cluster.sh             one node: this machine, under its own hostname
#   bash examples/slurm/local_cluster.sh --nodes 2   a controller and two nodes, node1 and node2, each
#                                                    with its own hostname and address
#   bash examples/slurm/local_cluster.sh --stop      the daemons stopped, the nodes' namespaces removed
#                                                    (munged, which other programs may use, keeps running)
# Idempotent: a second call with the same shape finds the daemons up and only waits for the nodes; a
# call with another shape stops the daemons and starts them on the new configuration. Concurrent calls
# (test workers) take turns on a lock.
#
# Several nodes: each slurmd runs in a network namespace of its own (a veth pair on a bridge) and a
# UTS namespace of its own (its hostname), so its jobs' processes have their own address and hostname,
# as on a cluster: the ranks meet at the first node's address, not at localhost, and their hostnames
# differ. Slurm's multiple-slurmd mode (this Debian build has it) would run several slurmd on this
# machine's hostname and address, each on its own port: node names would differ but every rank would
# see one hostname and reach the others on one address, which no cluster does. The namespaces share
# this machine's file systems, as the nodes of a cluster share a network file system: the output
# folder is one folder for every node. Names resolve through /etc/netns/<namespace>/hosts, mounted
# over /etc/hosts for the node's processes only (this machine's /etc/hosts is not changed). The
# bridge carries only the addresses below (SUBNET.1: the controller, on this machine; SUBNET.(10+i):
# node i) and is connected to no other interface: no traffic leaves this machine.
# LOCAL_CLUSTER_SUBNET picks another /24 where 10.213.64 is taken.
#
# Process tracking by parent PID (linuxproc) and no task plugin: no cgroups needed, so it also runs
# in a container. The signal paths are those of a cluster: slurmstepd signals every process of a step.
set -euo pipefail
nodes=1
case "${1:-}" in
  --nodes)
    nodes=${2:?--nodes needs a number}
    [[ "$nodes" =~ ^[1-9][0-9]?$ ]] || { echo "error: --nodes $nodes: give a number from 1 to 99" >&2; exit 2; } ;;
  --stop) nodes=0 ;;
  "") ;;
  *) echo "usage: bash $0 [--nodes N | --stop]" >&2; exit 2 ;;
esac
subnet=${LOCAL_CLUSTER_SUBNET:-10.213.64}
# A node that stops answering (its network cut) is declared DOWN, and its jobs requeued, after this many
# seconds; Slurm's default is 300. 30 keeps the tests' cut node (tests/test_slurm.py) to a minute.
slurmd_timeout=30
bridge=slurmbr0
exec 9>/run/local_slurm_cluster.lock
flock 9

host=$(hostname -s)
cpus=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # nproc obeys these (a test session sets OMP_NUM_THREADS=1)
memory=$(free -m | awk -v nodes="$((nodes > 0 ? nodes : 1))" '/^Mem:/ {print int($2 * 0.8 / nodes)}')

node_namespaces() { ip netns list 2>/dev/null | awk '$1 ~ /^slurm-node[0-9]+$/ {print $1}'; }

end_processes() {  # SIGTERM (slurmd and slurmctld save their state and exit), then SIGKILL after 15 s
  [ "$#" = 0 ] && return
  kill "$@" 2>/dev/null || true
  for _ in $(seq 30); do
    kill -0 "$@" 2>/dev/null || return 0
    sleep 0.5
  done
  kill -9 "$@" 2>/dev/null || true
}

stop_daemons() {  # what this script started: the daemons of its pid files, every process of the nodes'
  local pidfile namespace pids=()  # namespaces (slurmd, its steps, their jobs), the namespaces, the bridge
  for pidfile in /run/slurmctld.pid /run/slurmd.pid /run/slurmd-*.pid; do
    [ -s "$pidfile" ] && pids+=("$(cat "$pidfile")")
  done
  for namespace in $(node_namespaces); do
    pids+=($(ip netns pids "$namespace"))
  done
  end_processes "${pids[@]}"
  rm -f /run/slurmctld.pid /run/slurmd.pid /run/slurmd-*.pid
  for namespace in $(node_namespaces); do
    ip netns del "$namespace"
    rm -rf "/etc/netns/$namespace"
  done
  ip link del "$bridge" 2>/dev/null || true
}

if [ "$nodes" = 0 ]; then
  stop_daemons
  exit 0
fi

mkdir -p /etc/slurm /var/spool/slurmctld /var/spool/slurmd /var/log/slurm /run/munge /var/lib/munge /var/log/munge
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
fi
chown -R munge:munge /etc/munge /run/munge /var/lib/munge /var/log/munge 2>/dev/null || true
chmod 400 /etc/munge/munge.key

if [ "$nodes" = 1 ]; then
  controller=$host
  node_lines="NodeName=$host CPUs=$cpus RealMemory=$memory State=UNKNOWN"
  node_list=$host
else
  controller="$host($subnet.1)"  # slurmctld on this machine, reached on the bridge's address
  node_lines=$(for i in $(seq "$nodes"); do
    echo "NodeName=node$i NodeHostname=node$i NodeAddr=$subnet.$((10 + i)) CPUs=$cpus RealMemory=$memory State=UNKNOWN"
  done)
  node_list="node[1-$nodes]"
fi
config=$(cat <<CONF
ClusterName=local
SlurmctldHost=$controller
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
StateSaveLocation=/var/spool/slurmctld
SlurmctldPidFile=/run/slurmctld.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdSpoolDir=/var/spool/slurmd/%n
SlurmdPidFile=/run/slurmd-%n.pid
SlurmdLogFile=/var/log/slurm/slurmd-%n.log
ReturnToService=2
JobRequeue=1
KillWait=30
SlurmdTimeout=$slurmd_timeout
MinJobAge=600
$node_lines
PartitionName=debug Nodes=$node_list Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
CONF
)
restart=
if [ "$config" != "$(cat /etc/slurm/slurm.conf 2>/dev/null)" ]; then
  stop_daemons  # another shape (or a first start): its jobs are not carried over (slurmctld -c below)
  restart=-c
  echo "$config" > /etc/slurm/slurm.conf
fi

# The daemons are started without the lock's descriptor (9>&-): a daemon holding it would hold the lock.
pgrep -x munged >/dev/null || runuser -u munge -- munged --force 9>&- 2>/dev/null || munged --force 9>&-

running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

if [ "$nodes" -gt 1 ]; then
  if ! command -v ip >/dev/null || ! command -v nsenter >/dev/null; then
    echo "error: --nodes $nodes needs ip and nsenter: apt-get install -y iproute2 util-linux" >&2
    exit 1
  fi
  if ip route show | grep -v "dev $bridge" | grep -q "^$subnet\."; then
    echo "error: $subnet.0/24 is already routed on this machine: LOCAL_CLUSTER_SUBNET=A.B.C picks another /24" >&2
    exit 1
  fi
  if ! ip link show "$bridge" >/dev/null 2>&1; then
    ip link add "$bridge" type bridge
    ip addr add "$subnet.1/24" dev "$bridge"
    ip link set "$bridge" up
  fi
  for i in $(seq "$nodes"); do
    namespace=slurm-node$i
    if ! ip netns list | grep -qx "$namespace\( .*\)\?"; then
      ip netns add "$namespace"
      ip link add "veth-node$i" type veth peer name eth0 netns "$namespace"
      ip link set "veth-node$i" master "$bridge" up
      ip -n "$namespace" addr add "$subnet.$((10 + i))/24" dev eth0
      ip -n "$namespace" link set eth0 up
      ip -n "$namespace" link set lo up
    fi
    mkdir -p "/etc/netns/$namespace"
    # each address also in its IPv4-mapped IPv6 form, under which torch's c10d store (listening on
    # IPv6 and IPv4 at once) looks up a rank's hostname: else each rank warns that it cannot
    { echo "127.0.0.1 localhost"; echo "$subnet.1 $host"
      for j in $(seq "$nodes"); do echo "$subnet.$((10 + j)) node$j"; echo "::ffff:$subnet.$((10 + j)) node$j"; done
    } > "/etc/netns/$namespace/hosts"
  done
fi

running /run/slurmctld.pid || slurmctld $restart 9>&-
if [ "$nodes" = 1 ]; then
  mkdir -p "/var/spool/slurmd/$host"
  running "/run/slurmd-$host.pid" || slurmd 9>&-
else
  for i in $(seq "$nodes"); do
    # its own hostname in a UTS namespace of its own (slurmd finds its NodeName by it, and the jobs see
    # it), and a mount namespace of its own for its /etc/hosts (not `ip netns exec`, which also mounts
    # a /sys of its own, where slurmd finds no cgroup file system and refuses to start)
    mkdir -p "/var/spool/slurmd/node$i"
    running "/run/slurmd-node$i.pid" ||
      nsenter --net="/run/netns/slurm-node$i" unshare --uts --mount --propagation slave \
        sh -c "mount --bind /etc/netns/slurm-node$i/hosts /etc/hosts && hostname node$i && exec slurmd" 9>&-
  done
fi
for _ in $(seq 60); do
  if [ "$(sinfo -h -N -o %t 2>/dev/null | grep -cE '^(idle|mix|alloc)')" = "$nodes" ]; then
    exit 0
  fi
  scontrol update nodename="$node_list" state=resume >/dev/null 2>&1 || true
  sleep 1
done
echo "error: the local Slurm nodes did not come up; see /var/log/slurm/*.log" >&2
sinfo -N >&2 || true
exit 1
