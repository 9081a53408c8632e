#!/usr/bin/env bash
# Two simulated hosts joined by an impaired link, for tests and benchmarks
# on kernels without sch_netem:
#
#   NAME-a (eth0 10.99.0.1) -- veth -- NAME-m (chorus netem) -- veth -- NAME-b (eth0 10.99.0.2)
#
# NAME-m has no addresses and no bridge, so every frame between the hosts
# passes through `chorus netem` and its loss, delay, jitter and rate.
#
#   scripts/netem-pair.sh up NAME [chorus netem flags: --delay-ms 20 --loss 1% ...]
#   ip netns exec NAME-a ...      # host a; host b is 10.99.0.2 in NAME-b
#   scripts/netem-pair.sh down NAME
#
# Needs root. Exits 2 when network namespaces cannot be made here.
# CHORUS names the binary (default: target/release/chorus of this checkout);
# NETEM_DIR holds the impairer's pid and log (default: /tmp/chorus-netem).
set -euo pipefail

usage() {
    echo "usage: $0 up NAME [chorus netem flags] | down NAME" >&2
    exit 64
}
[ $# -ge 2 ] || usage
action=$1
name=$2
shift 2
root=$(cd "$(dirname "$0")/.." && pwd)
chorus=${CHORUS:-$root/target/release/chorus}
dir=${NETEM_DIR:-/tmp/chorus-netem}
a=$name-a
m=$name-m
b=$name-b

down() {
    if [ -f "$dir/$name.pid" ]; then
        pid=$(cat "$dir/$name.pid")
        kill -TERM "$pid" 2>/dev/null || true
        # Give it a moment to print its counts, then make sure it is gone.
        for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.02; done
        kill -KILL "$pid" 2>/dev/null || true
        rm -f "$dir/$name.pid"
    fi
    for ns in "$a" "$m" "$b"; do ip netns del "$ns" 2>/dev/null || true; done
    if [ -f "$dir/$name.log" ]; then grep -h '^netem: .* forwarded' "$dir/$name.log" >&2 || true; fi
    rm -f "$dir/$name.log"
}

case $action in
down)
    down
    ;;
up)
    mkdir -p "$dir"
    if ! ip netns add "$a" 2>"$dir/$name.log"; then
        echo "cannot make network namespaces here (root and ip netns needed): $(cat "$dir/$name.log")" >&2
        exit 2
    fi
    trap 'down' ERR
    ip netns add "$m"
    ip netns add "$b"
    ip -n "$m" link add wire-a type veth peer eth0 netns "$a"
    ip -n "$m" link add wire-b type veth peer eth0 netns "$b"
    i=1
    for ns in "$a" "$b"; do
        # One frame per transmission, so that a drop loses one frame and not
        # a 64 KB offload batch (netem on a NIC sees frames of the MTU too).
        ip -n "$ns" link set eth0 gso_max_segs 1
        ip -n "$ns" addr add 10.99.0.$i/24 dev eth0
        ip -n "$ns" link set eth0 up
        ip -n "$ns" link set lo up
        ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1
        i=$((i + 1))
    done
    ip -n "$m" link set wire-a up
    ip -n "$m" link set wire-b up
    ip -n "$m" link set lo up
    ip netns exec "$m" sysctl -qw net.ipv6.conf.all.disable_ipv6=1
    # Static neighbours: no ARP exchange to lose or to wait for.
    mac_a=$(ip -n "$a" -br link show eth0 | awk '{print $3}')
    mac_b=$(ip -n "$b" -br link show eth0 | awk '{print $3}')
    ip -n "$a" neigh replace 10.99.0.2 lladdr "$mac_b" dev eth0 nud permanent
    ip -n "$b" neigh replace 10.99.0.1 lladdr "$mac_a" dev eth0 nud permanent
    ip netns exec "$m" "$chorus" netem --a wire-a --b wire-b "$@" >>"$dir/$name.log" 2>&1 &
    echo $! >"$dir/$name.pid"
    for _ in $(seq 200); do
        if grep -q '^netem: ready' "$dir/$name.log"; then
            grep -h '^netem: ready' "$dir/$name.log" >&2
            exit 0
        fi
        kill -0 "$(cat "$dir/$name.pid")" 2>/dev/null || break
        sleep 0.05
    done
    echo "chorus netem did not start within 10s: $(cat "$dir/$name.log")" >&2
    down
    exit 1
    ;;
*)
    usage
    ;;
esac
