#!/usr/bin/env bash
# A simulated cluster on one machine, for multi-host tests (run as root).
#
# Each host is a network namespace with its own host name (UTS namespace) and
# its own /dev/shm (mount namespace, a fresh tmpfs), an `eth0` with
# 10.77.0.<i>/24, and a decoy `docker0` with 172.17.0.1/16 on every host (as
# on machines running Docker), up and running, that must never be chosen.
# Every host's eth0 reaches a switch namespace through a link namespace of
# its own; the link bridges its two ends in the kernel, or, after `impair`,
# through `chorus netem` (this kernel has no sch_netem), so a link can get
# delay and loss. `cut` takes a host off the switch (a partition).
#
#   sim-cluster.sh up PREFIX N [--same-hostname] [--shared-shm] [--share-net I:J ...]
#       --same-hostname  every host keeps this machine's name (`ip netns exec`)
#       --shared-shm     hosts share this machine's /dev/shm (docker --ipc=host)
#       --share-net I:J  host J lives in host I's network namespace (docker
#                        --network container:I, pods): loopback reaches, /dev/shm
#                        differs unless --shared-shm
#   sim-cluster.sh exec PREFIX I -- COMMAND...   run on host I
#   sim-cluster.sh cut PREFIX I | heal PREFIX I  partition host I / undo it
#   sim-cluster.sh kill PREFIX I                 SIGKILL everything on host I
#                                                (the host dies; its net stays)
#   sim-cluster.sh impair PREFIX I NETEM-ARGS... host I's link through `chorus netem`
#                                                ($CHORUS or `chorus` on PATH)
#   sim-cluster.sh down PREFIX                   remove everything PREFIX made
#
# PREFIX is at most 6 characters (interface names are limited to 15).
set -euo pipefail

STATE=/run/chorus-sim

die() { echo "sim-cluster: $*" >&2; exit 1; }

ns_host() { echo "$1-h$2"; }
ns_link() { echo "$1-l$2"; }
ns_switch() { echo "$1-sw"; }

# Persisting a mount namespace needs its bind mount on a private mount.
prepare_state() {
    mkdir -p "$STATE"
    if ! findmnt -rn "$STATE" >/dev/null 2>&1; then
        mount --bind "$STATE" "$STATE"
        mount --make-private "$STATE"
    fi
}

# The namespace files a host's commands enter: its own net (or the one it
# shares), UTS and mount.
host_net() {
    local prefix=$1 i=$2
    if [ -f "$STATE/$(ns_host "$prefix" "$i").net-of" ]; then
        i=$(cat "$STATE/$(ns_host "$prefix" "$i").net-of")
    fi
    echo "/run/netns/$(ns_host "$prefix" "$i")"
}

cmd_up() {
    local prefix=$1 n=$2
    shift 2
    local same_hostname=0 shared_shm=0
    declare -A net_of=()
    while [ $# -gt 0 ]; do
        case $1 in
            --same-hostname) same_hostname=1 ;;
            --shared-shm) shared_shm=1 ;;
            --share-net) net_of[${2#*:}]=${2%%:*}; shift ;;
            *) die "unknown option $1" ;;
        esac
        shift
    done
    [ ${#prefix} -le 6 ] || die "prefix $prefix is longer than 6 characters"
    prepare_state
    local sw
    sw=$(ns_switch "$prefix")
    ip netns add "$sw"
    ip -n "$sw" link set lo up
    ip -n "$sw" link add br0 type bridge
    ip -n "$sw" link set br0 up
    local i host link
    for i in $(seq 1 "$n"); do
        host=$(ns_host "$prefix" "$i")
        if [ -n "${net_of[$i]:-}" ]; then
            echo "${net_of[$i]}" >"$STATE/$host.net-of"
        else
            link=$(ns_link "$prefix" "$i")
            ip netns add "$host"
            ip netns add "$link"
            ip -n "$host" link set lo up
            ip -n "$link" link set lo up
            # host eth0 <-> link side a; link side b <-> switch port.
            ip link add "$prefix-e$i" type veth peer name "$prefix-a$i"
            ip link set "$prefix-e$i" netns "$host"
            ip link set "$prefix-a$i" netns "$link"
            ip -n "$host" link set "$prefix-e$i" name eth0
            ip -n "$link" link set "$prefix-a$i" name a
            ip link add "$prefix-b$i" type veth peer name "$prefix-p$i"
            ip link set "$prefix-b$i" netns "$link"
            ip link set "$prefix-p$i" netns "$sw"
            ip -n "$link" link set "$prefix-b$i" name b
            ip -n "$sw" link set "$prefix-p$i" name "p$i"
            ip -n "$host" addr add "10.77.0.$i/24" dev eth0
            ip -n "$host" link set eth0 up
            ip -n "$link" link add kbr type bridge
            ip -n "$link" link set dev a master kbr
            ip -n "$link" link set dev b master kbr
            ip -n "$link" link set dev a up
            ip -n "$link" link set dev b up
            ip -n "$link" link set dev kbr up
            ip -n "$sw" link set "p$i" master br0
            ip -n "$sw" link set "p$i" up
            # The decoy: same address everywhere, up and running.
            ip -n "$host" link add docker0 type veth peer name vethdk
            ip -n "$host" addr add 172.17.0.1/16 dev docker0
            ip -n "$host" link set vethdk up
            ip -n "$host" link set docker0 up
        fi
        touch "$STATE/$host.uts" "$STATE/$host.mnt"
        local name
        if [ "$same_hostname" = 1 ]; then name=$(hostname); else name="$prefix-host$i"; fi
        if [ "$shared_shm" = 1 ]; then
            unshare --uts="$STATE/$host.uts" --mount="$STATE/$host.mnt" hostname "$name"
        else
            unshare --uts="$STATE/$host.uts" --mount="$STATE/$host.mnt" \
                sh -c "hostname '$name' && mount -t tmpfs -o size=1g tmpfs /dev/shm"
        fi
    done
    echo "$n" >"$STATE/$prefix.hosts"
}

cmd_exec() {
    local prefix=$1 i=$2
    shift 2
    [ "${1:-}" = "--" ] && shift
    local host
    host=$(ns_host "$prefix" "$i")
    [ -f "$STATE/$host.uts" ] || die "no host $i in cluster $prefix"
    exec nsenter --net="$(host_net "$prefix" "$i")" --uts="$STATE/$host.uts" --mount="$STATE/$host.mnt" -- "$@"
}

cmd_cut() { ip -n "$(ns_link "$1" "$2")" link set dev b down; }
cmd_heal() { ip -n "$(ns_link "$1" "$2")" link set dev b up; }

# Every process in host I's network namespace, as when the host dies:
# their sockets close, so peers see resets, not silence (that is `cut`).
cmd_kill() {
    local pids
    pids=$(ip netns pids "$(basename "$(host_net "$1" "$2")")")
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
}

cmd_impair() {
    local prefix=$1 i=$2
    shift 2
    local link
    link=$(ns_link "$prefix" "$i")
    ip -n "$link" link set dev a nomaster
    ip -n "$link" link set dev b nomaster
    ip -n "$link" link del dev kbr
    # One frame per transmission on every host: a loss then drops one frame,
    # not a 64 KB offload batch, as on a real link.
    local h
    for h in $(seq 1 "$(cat "$STATE/$prefix.hosts")"); do
        [ -e "/run/netns/$(ns_host "$prefix" "$h")" ] || continue
        ip -n "$(ns_host "$prefix" "$h")" link set dev eth0 gso_max_segs 1 2>/dev/null || true
    done
    ip netns exec "$link" "${CHORUS:-chorus}" netem --a a --b b "$@" \
        >"$STATE/$link.netem.log" 2>&1 &
    echo $! >"$STATE/$link.netem.pid"
}

cmd_down() {
    local prefix=$1 f pid
    for f in "$STATE/$prefix"-l*.netem.pid; do
        [ -f "$f" ] || continue
        pid=$(cat "$f")
        kill "$pid" 2>/dev/null || true
        rm -f "$f"
    done
    # Processes still in a host's namespaces would keep them alive.
    for f in /run/netns/"$prefix"-*; do
        [ -e "$f" ] || continue
        ip netns pids "$(basename "$f")" 2>/dev/null | xargs -r kill -9 2>/dev/null || true
        ip netns del "$(basename "$f")" 2>/dev/null || true
    done
    for f in "$STATE/$prefix"-h*.uts "$STATE/$prefix"-h*.mnt; do
        [ -e "$f" ] || continue
        umount "$f" 2>/dev/null || true
        rm -f "$f"
    done
    rm -f "$STATE/$prefix"-h*.net-of "$STATE/$prefix"-l*.netem.log "$STATE/$prefix.hosts"
}

case ${1:-} in
    up) shift; [ $# -ge 2 ] || die "usage: up PREFIX N [options]"; cmd_up "$@" ;;
    exec) shift; [ $# -ge 3 ] || die "usage: exec PREFIX I -- COMMAND..."; cmd_exec "$@" ;;
    cut) shift; cmd_cut "$@" ;;
    heal) shift; cmd_heal "$@" ;;
    kill) shift; [ $# -eq 2 ] || die "usage: kill PREFIX I"; cmd_kill "$@" ;;
    impair) shift; [ $# -ge 2 ] || die "usage: impair PREFIX I NETEM-ARGS..."; cmd_impair "$@" ;;
    down) shift; [ $# -ge 1 ] || die "usage: down PREFIX"; cmd_down "$@" ;;
    *) sed -n '2,27p' "$0"; exit 2 ;;
esac
