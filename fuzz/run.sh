#!/usr/bin/env bash
# Runs every fuzz target (or those named) for SECONDS_PER_TARGET seconds each (default 90),
# seeded from seeds/<target>, growing corpus/<target>; a crash stops the
# run and leaves its input in artifacts/<target>/.
# Stable toolchain: no sanitizer (`--sanitizer none`), no RUSTC_BOOTSTRAP;
# that is only needed for the sanitizer builds (`-Zsanitizer=...`).
set -euo pipefail
cd "$(dirname "$0")"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-/tmp/chorus-fuzz-target}"
seconds="${SECONDS_PER_TARGET:-90}"
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cargo fuzz list)
fi
for target in "${targets[@]}"; do
    mkdir -p "corpus/$target" "seeds/$target"
    dict=()
    [ -f "$target.dict" ] && dict=("-dict=$target.dict")
    echo "== $target (${seconds}s)"
    cargo fuzz run --sanitizer none "$target" "corpus/$target" "seeds/$target" -- \
        -max_total_time="$seconds" -timeout=10 -print_final_stats=1 "${dict[@]}"
done
# file_store_log's scratch directories of runs that have ended (libFuzzer
# exits without unwinding, so the target cannot remove its own).
for dir in /dev/shm/chorus-fuzz-file-store-* "${TMPDIR:-/tmp}"/chorus-fuzz-file-store-*; do
    [ -d "$dir" ] || continue
    kill -0 "${dir##*-}" 2>/dev/null || rm -rf -- "$dir"
done
