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
#   sudo bench/netns_wan.sh status                                 show addresses and qdiscs
#   sudo bench/netns_wan.sh down [N=2]                             delete everything
#
# Worker I gets 10.77.0.(I+1)/24 on interface lcw I; rank 0 is the rendezvous, e.g. on 2 workers
# (latency emulated by the runtime, bandwidth left to tbf):
#   sudo bench/netns_wan.sh exec 0 env GLOO_SOCKET_IFNAME=lcw0 torchrun --nnodes=2 --node-rank=0 \
#       --nproc-per-node=1 --master-addr=10.77.0.1 --master-port=29500 \
#       python/torchrun_train.py --method streaming --latency-ms 50 --bandwidth-mbps inf &
#   sudo bench/netns_wan.sh exec 1 env GLOO_SOCKET_IFNAME=lcw1 torchrun --nnodes=2 --node-rank=1 \
#       --nproc-per-node=1 --master-addr=10.77.0.1 --master-port=29500 \
#       python/torchrun_train.py --method streaming --latency-ms 50 --bandwidth-mbps inf
set -euo pipefail

cmd=${1:-}
shift || true
SUBNET=10.77.0

die() { echo "netns_wan.sh: $*" >&2; exit 1; }
need_root() { [ "$(id -u)" -eq 0 ] || die "needs root (CAP_NET_ADMIN); run with sudo"; }

shape() {  # shape NS IFACE RATE BURST: egress token bucket on IFACE inside NS
  ip netns exec "$1" tc qdisc replace dev "$2" root tbf rate "$3" burst "$4" latency 500ms
}

case "$cmd" in
  up)
    need_root
    N=${1:-2}; RATE=${2:-1gbit}; BURST=${3:-256kb}
    [ "$N" -ge 2 ] || die "N must be >= 2"
    ip netns add lc-hub
    ip netns exec lc-hub ip link add lcbr type bridge
    ip netns exec lc-hub ip link set lcbr up
    ip netns exec lc-hub ip link set lo up
    for ((i = 0; i < N; i++)); do
      ns=lc$i
      ip netns add "$ns"
      ip link add "lcw$i" netns "$ns" type veth peer name "lch$i" netns lc-hub
      ip netns exec "$ns" ip addr add "$SUBNET.$((i + 1))/24" dev "lcw$i"
      ip netns exec "$ns" ip link set "lcw$i" up
      ip netns exec "$ns" ip link set lo up
      ip netns exec lc-hub ip link set "lch$i" master lcbr
      ip netns exec lc-hub ip link set "lch$i" up
      # both directions: worker egress (upload) and hub egress towards the worker (download)
      shape "$ns" "lcw$i" "$RATE" "$BURST"
      shape lc-hub "lch$i" "$RATE" "$BURST"
    done
    echo "up: $N workers at $SUBNET.1..$SUBNET.$N, $RATE each way (tbf, burst $BURST)"
    ;;
  exec)
    need_root
    i=${1:?worker index}; shift
    exec ip netns exec "lc$i" "$@"
    ;;
  status)
    for ns in $(ip netns list | awk '/^lc/{print $1}'); do
      echo "== $ns"; ip netns exec "$ns" ip -brief addr; ip netns exec "$ns" tc qdisc show
    done
    ;;
  down)
    need_root
    N=${1:-2}
    for ((i = 0; i < N; i++)); do ip netns del "lc$i" 2>/dev/null || true; done
    ip netns del lc-hub 2>/dev/null || true
    echo "down"
    ;;
  *)
    awk 'NR > 1 && !/^#/ {exit} NR > 1' "$0"  # the comment block above
    exit 2
    ;;
esac
