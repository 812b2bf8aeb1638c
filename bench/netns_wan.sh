#!/usr/bin/env bash
# Real shaped links between local workers: N network namespaces joined through a hub namespace by
# veth pairs, each direction rate-limited with `tc tbf` (token bucket). This kernel has no netem, so
# there is no qdisc-level delay: combine with the runtime's emulated latency,
# `wan=WAN(latency_s=0.05, bandwidth_bytes_per_s=float("inf"))`-style (bandwidth from tbf, latency
# from the runtime) or leave latency at 0.
#
# Needs root (CAP_NET_ADMIN) and iproute2.
#   sudo bench/netns_wan.sh up [N=2] [RATE=1gbit] [BURST=256kb]   create lc-hub + lc0..lc{N-1}
#   sudo bench/netns_wan.sh exec I CMD...                          run CMD inside worker I's namespace
#   sudo bench/netns_wan.sh cut I                                  take worker I's link down
#   sudo bench/netns_wan.sh restore I                              bring it back up
#   sudo bench/netns_wan.sh status                                 show addresses and qdiscs
#   sudo bench/netns_wan.sh down [N=2]                             delete everything
#
# Worker I gets $LC_SUBNET.(I+1)/24 on interface lcw I; a command run by `exec I` sees the hostname
# lcI, and the names lc0 .. lc{N-1} and lc-host resolve to the addresses in every namespace. The namespace the script runs in (the host)
# joins the hub's bridge at $LC_SUBNET.254 (unshaped), so a service started outside the namespaces
# (a torchft Lighthouse, a rendezvous store) is reachable from every worker at that address.
# Names and subnet come from the environment, so several sets can exist side by side:
#   LC_NS=lc          prefix of every namespace and interface (<= 8 characters: interface names
#                     are at most 15), e.g. LC_NS=t1234 gives t1234-hub, t12340, t1234w0 ...
#   LC_SUBNET=10.77.0 the /24 the workers share (pick one no other interface of the host uses)
# Rank 0 is the rendezvous, e.g. on 2 workers (latency emulated by the runtime, bandwidth left to tbf):
#   sudo bench/netns_wan.sh exec 0 env GLOO_SOCKET_IFNAME=lcw0 torchrun --nnodes=2 --node-rank=0 \
#       --nproc-per-node=1 --master-addr=10.77.0.1 --master-port=29500 \
#       python/torchrun_train.py --method streaming --latency-ms 50 --bandwidth-mbps inf &
#   sudo bench/netns_wan.sh exec 1 env GLOO_SOCKET_IFNAME=lcw1 torchrun --nnodes=2 --node-rank=1 \
#       --nproc-per-node=1 --master-addr=10.77.0.1 --master-port=29500 \
#       python/torchrun_train.py --method streaming --latency-ms 50 --bandwidth-mbps inf
set -euo pipefail

cmd=${1:-}
shift || true
P=${LC_NS:-lc}
SUBNET=${LC_SUBNET:-10.77.0}

die() { echo "netns_wan.sh: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" -eq 0 ] || die "needs root (CAP_NET_ADMIN); run with sudo"; }
[[ "$P" =~ ^[a-z][a-z0-9]{0,7}$ ]] || die "LC_NS must be 1-8 lower-case letters/digits, got '$P'"
[[ "$SUBNET" =~ ^[0-9]{1,3}\.[0-9]{1,3}\.[0-9]{1,3}$ ]] || die "LC_SUBNET must look like 10.77.0, got '$SUBNET'"
worker() {  # worker INDEX: checks it names a namespace of this set
  [[ "${1:-}" =~ ^[0-9]+$ ]] || die "worker index must be a number, got '${1:-}'"
  ip netns list | awk '{print $1}' | grep -qx "$P$1" || die "no namespace $P$1 (run 'up' first)"
}

shape() {  # shape NS IFACE RATE BURST: egress token bucket on IFACE inside NS
  ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$3" burst "$4" latency 500ms
}

case "$cmd" in
  up)
    need_root
    N=${1:-2}; RATE=${2:-1gbit}; BURST=${3:-256kb}
    [[ "$N" =~ ^[0-9]+$ ]] && [ "$N" -ge 2 ] && [ "$N" -le 250 ] || die "N must be 2 .. 250, got '$N'"
    ip netns list | awk '{print $1}' | grep -qx "$P-hub" && die "$P-hub exists (another set? 'down' it or pick LC_NS)"
    ip netns add "$P-hub"
    ip netns exec "$P-hub" ip link add "${P}br" type bridge
    ip netns exec "$P-hub" ip link set "${P}br" up
    ip netns exec "$P-hub" ip link set lo up
    # the host's leg: reaches every worker through the bridge
    ip link add "${P}host" type veth peer name "${P}hh" netns "$P-hub"
    ip addr add "$SUBNET.254/24" dev "${P}host"
    ip link set "${P}host" up
    ip netns exec "$P-hub" ip link set "${P}hh" master "${P}br"
    ip netns exec "$P-hub" ip link set "${P}hh" up
    for ((i = 0; i < N; i++)); do
      ns=$P$i
      ip netns add "$ns"
      ip link add "${P}w$i" netns "$ns" type veth peer name "${P}h$i" netns "$P-hub"
      ip netns exec "$ns" ip addr add "$SUBNET.$((i + 1))/24" dev "${P}w$i"
      ip netns exec "$ns" ip link set "${P}w$i" up
      ip netns exec "$ns" ip link set lo up
      ip netns exec "$P-hub" ip link set "${P}h$i" master "${P}br"
      ip netns exec "$P-hub" ip link set "${P}h$i" up
      # both directions: worker egress (upload) and hub egress towards the worker (download)
      shape "$ns" "${P}w$i" "$RATE" "$BURST"
      shape "$P-hub" "${P}h$i" "$RATE" "$BURST"
    done
    # names: inside worker I's namespace `exec` gives the process the hostname $P$I (its own UTS
    # namespace), and every namespace's /etc/hosts (what `ip netns exec` mounts from /etc/netns/<ns>)
    # resolves all of them: a service that advertises its hostname (torchft's checkpoint server,
    # gloo, c10d stores) is reached by the others at the right address, not on their own loopback
    hosts=$(printf '127.0.0.1 localhost\n%s %s-host\n' "$SUBNET.254" "$P"
            for ((i = 0; i < N; i++)); do printf '%s %s\n' "$SUBNET.$((i + 1))" "$P$i"; done)
    for ns in "$P-hub" $(for ((i = 0; i < N; i++)); do echo "$P$i"; done); do
      mkdir -p "/etc/netns/$ns"
      echo "$hosts" > "/etc/netns/$ns/hosts"
    done
    echo "up: $N workers at $SUBNET.1..$SUBNET.$N, $RATE each way (tbf, burst $BURST); host at $SUBNET.254"
    ;;
  exec)
    need_root
    i=${1:-}; worker "$i"; shift
    # shellcheck disable=SC2016  # $0 and $@ belong to the inner shell
    exec ip netns exec "$P$i" unshare --uts sh -c 'hostname "$0" && exec "$@"' "$P$i" "$@"
    ;;
  cut | restore)
    need_root
    i=${1:-}; worker "$i"
    state=$([ "$cmd" = cut ] && echo down || echo up)
    ip netns exec "$P$i" ip link set "${P}w$i" "$state"
    echo "$cmd: worker $i (${P}w$i $state)"
    ;;
  status)
    for ns in $(ip netns list | awk -v p="$P" 'index($1, p) == 1 {print $1}'); do
      echo "== $ns"; ip netns exec "$ns" ip -brief addr; ip netns exec "$ns" tc qdisc show
    done
    ;;
  down)
    need_root
    N=${1:-2}
    for ((i = 0; i < N; i++)); do
      ip netns del "$P$i" 2>/dev/null || true
      rm -rf "/etc/netns/$P$i"
    done
    ip netns del "$P-hub" 2>/dev/null || true  # takes the host's leg (${P}host) with it
    rm -rf "/etc/netns/$P-hub"
    ip link del "${P}host" 2>/dev/null || true
    echo "down"
    ;;
  *)
    awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"  # the comment block above
    exit 2
    ;;
esac
