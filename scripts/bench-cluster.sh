#!/usr/bin/env bash
# The 16 MiB all-reduce of `chorus hello` (one rank per host, QUIC between
# hosts) across 3 simulated hosts (scripts/sim-cluster.sh), on clean links
# and through `chorus netem` on every host's link: 20 ms, 1% loss, both.
# Prints each run's time and the median per setting. Needs root.
#
#   scripts/bench-cluster.sh [RUNS]      (CHORUS: the binary, default target/release/chorus)
set -euo pipefail
cd "$(dirname "$0")/.."
runs=${1:-5}
export CHORUS=${CHORUS:-$PWD/target/release/chorus}
export CHORUS_JOB_SECRET=bench-cluster
prefix=bcl$$
prefix=${prefix:0:6}
trap 'scripts/sim-cluster.sh down $prefix' EXIT

one_run() {
    local pids=() i
    for i in 1 2 3; do
        scripts/sim-cluster.sh exec "$prefix" "$i" -- "$CHORUS" launch --nnodes 3 --nproc-per-node 1 \
            --master-addr 10.77.0.1 --master-port 29500 -- "$CHORUS" hello --worker env:// --timeout 120 \
            >"/tmp/$prefix.$i.log" 2>&1 &
        pids+=($!)
    done
    for i in "${pids[@]}"; do wait "$i"; done
    # "[0]: all_reduce of 16 MiB float32: every element is 6, correct; 229.4 ms, busbw ..."
    grep -ho '[0-9.]* ms, busbw' "/tmp/$prefix.1.log" | cut -d' ' -f1
}

for setting in clean "--delay-ms 20" "--loss 1%" "--delay-ms 20 --loss 1%"; do
    scripts/sim-cluster.sh down "$prefix"
    scripts/sim-cluster.sh up "$prefix" 3
    if [ "$setting" != clean ]; then
        for i in 1 2 3; do
            # shellcheck disable=SC2086
            scripts/sim-cluster.sh impair "$prefix" "$i" $setting --seed "$i"
        done
    fi
    times=()
    for _ in $(seq 1 "$runs"); do times+=("$(one_run)"); done
    median=$(printf '%s\n' "${times[@]}" | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
    echo "$setting: ${times[*]} ms; median $median ms"
done
