#!/usr/bin/env bash
# QUIC against kernel TCP between two simulated hosts (scripts/netem-pair.sh)
# on a clean link, with 20 ms delay each way, with 1% loss each way, and both:
# medians of `chorus bench transport` rounds, one fresh connection per sample.
#
#   scripts/bench-impaired.sh [ROUNDS [SIZE]]     (default 5 rounds of 16 MiB)
#   QUIC_CONGESTION=cubic scripts/bench-impaired.sh   (QUIC as before BBR)
#
# Needs root. CHORUS names the binary (default: target/release/chorus).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
export CHORUS=${CHORUS:-$root/target/release/chorus}
rounds=${1:-5}
size=${2:-$((16 << 20))}
name=chbench$$
trap '"$root/scripts/netem-pair.sh" down "$name" 2>/dev/null' EXIT

echo "# $size B per sample, median of $rounds rounds; delay and loss apply to each direction"
printf '# %-22s %-5s %10s %12s\n' link path "MB/s" "rtt 8B(ms)"
for link in "clean:" "20ms:--delay-ms 20" "1%-loss:--loss 1%" "20ms+1%-loss:--delay-ms 20 --loss 1%"; do
    label=${link%%:*}
    # shellcheck disable=SC2086 # the flags are words
    "$root/scripts/netem-pair.sh" up "$name" ${link#*:} --seed 1 2>/dev/null
    timeout 600 ip netns exec "$name-a" "$CHORUS" bench transport --json --paths tcp,quic \
        --size "$size" --iters 1 --rtt-iters 20 --rounds "$rounds" --quic-congestion "${QUIC_CONGESTION:-auto}" \
        --bind 10.99.0.1 --peer-bind 10.99.0.2 --peer-prefix "ip netns exec $name-b" |
        awk -v link="$label" -F'[:,"]+' '{
            for (i = 1; i < NF; i++) v[$i] = $(i + 1)
            printf "  %-22s %-5s %10.1f %12.1f\n", link, v["path"], v["gbps"] * 1000, v["rtt_us"] / 1000
        }'
    "$root/scripts/netem-pair.sh" down "$name" 2>/dev/null
done
