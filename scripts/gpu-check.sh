#!/usr/bin/env bash
# The GPU check of chorus's NCCL backend: tests/nccl.rs with its ignored
# gpu_ tests included (they fail without a device), examples/nccl_all_reduce, and
# `chorus launch --nproc-per-node <GPUs> -- chorus selftest --backend nccl`
# (one process per GPU, as torchrun runs them), each under a timeout, then a
# compact summary. Exit status: the number of failed checks.
#
#   scripts/gpu-check.sh prepare   # here, with the crates at hand: builds the
#                                  # three into target/gpu-check/bin (carry that path)
#   scripts/gpu-check.sh           # on the GPU machine (no network): uses
#                                  # target/gpu-check/bin, else builds with cargo
#
# GPU_CHECK_TIMEOUT (seconds per step, default 240) and GPU_CHECK_MAX_BYTES
# (the example's largest size, default 256M) tune it.
set -uo pipefail
cd "$(dirname "$0")/.."
BIN=target/gpu-check/bin
STEP_TIMEOUT=${GPU_CHECK_TIMEOUT:-240}
export PATH="$HOME/.cargo/bin:$PATH"

say() { echo "gpu-check: $*"; }

if [ "${1:-}" = prepare ]; then
    cargo build --release --test nccl --example nccl_all_reduce --bin chorus || exit 1
    test_bin=$(cargo test --release --test nccl --no-run --message-format=json 2>/dev/null |
        sed -n 's/.*"executable":"\([^"]*\)".*/\1/p' | tail -n 1)
    [ -x "$test_bin" ] || { say "could not find the test binary"; exit 1; }
    mkdir -p "$BIN"
    cp "$test_bin" "$BIN/nccl-tests" && cp target/release/examples/nccl_all_reduce target/release/chorus "$BIN/"
    strip "$BIN"/* 2>/dev/null || true
    du -sh "$BIN"
    exit 0
fi

results=()
record() { results+=("$(printf '%-5s %s' "$1" "$2")"); }
finish() {
    echo "gpu-check summary:"
    printf '  %s\n' "${results[@]}"
    exit "$(printf '%s\n' "${results[@]}" | grep -c '^FAIL')"
}

# 1. The device and its driver.
if command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
else
    say "nvidia-smi not found (the driver may still be there)"
fi

# 2. libnccl: the loader looks for libnccl.so, which pip wheels and the libnccl2 package do not ship
#    (they have libnccl.so.2), so link one in a directory of our own.
find_nccl() {
    ldconfig -p 2>/dev/null | awk '/libnccl\.so/ {print $NF}'
    for py in python3 python; do
        command -v "$py" >/dev/null &&
            "$py" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null
    done
    ls /usr/lib/x86_64-linux-gnu/libnccl.so* /usr/local/cuda*/lib64/libnccl.so* \
        /usr/local/cuda*/targets/*/lib/libnccl.so* /usr/local/nccl*/lib/libnccl.so* /opt/nccl*/lib/libnccl.so* \
        /usr/local/lib/python3*/*-packages/nvidia/nccl/lib/libnccl.so* \
        /usr/lib/python3*/*-packages/nvidia/nccl/lib/libnccl.so* \
        "$HOME"/.local/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so* 2>/dev/null
}
nccl=""
for candidate in $(find_nccl); do
    if [ -e "$candidate" ]; then nccl=$(readlink -f "$candidate"); break; fi
done
if [ -n "$nccl" ]; then
    shim=$(pwd)/target/gpu-check/lib
    mkdir -p "$shim" && ln -sf "$nccl" "$shim/libnccl.so"
    export LD_LIBRARY_PATH="$shim:$(dirname "$nccl")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    record PASS "libnccl: $nccl"
else
    record FAIL "libnccl: not found (ldconfig, CUDA/NCCL paths, pip nvidia-nccl-cu12); the checks below will say so"
fi

# 3. The binaries: carried in, or built here.
if [ ! -x "$BIN/nccl-tests" ] || [ ! -x "$BIN/nccl_all_reduce" ] || [ ! -x "$BIN/chorus" ]; then
    if ! command -v cargo >/dev/null; then
        record FAIL "no prepared binaries in $BIN and no cargo: run 'scripts/gpu-check.sh prepare' where the crates are and carry $BIN"
        finish
    fi
    cargo --version
    if ! timeout "$STEP_TIMEOUT" bash scripts/gpu-check.sh prepare; then
        record FAIL "build (no network here: the crates must be in ~/.cargo already)"
        finish
    fi
fi

# 4. The tests, GPU ones required.
log=target/gpu-check/tests.log
NCCL_DEBUG=${NCCL_DEBUG:-WARN} timeout "$STEP_TIMEOUT" \
    "$BIN/nccl-tests" --include-ignored --test-threads=1 --nocapture >"$log" 2>&1
status=$?
grep -E -A1 'panicked' "$log" | grep -v -e '^--' -e 'panicked' | sort -u | head -n 10
grep -E '^test .*(ok|FAILED)$|test result|skipping|abandoned' "$log" | tail -n 20
if [ $status -eq 0 ]; then
    record PASS "tests/nccl.rs: $(grep -o '[0-9]* passed' "$log" | tail -n 1)"
else
    record FAIL "tests/nccl.rs (exit $status$([ $status -eq 124 ] && echo ', timed out'); $log)"
fi

# 5. The example: correctness and the nccl-tests table.
log=target/gpu-check/example.log
timeout "$STEP_TIMEOUT" "$BIN/nccl_all_reduce" -b 1K -e "${GPU_CHECK_MAX_BYTES:-256M}" -f 4 >"$log" 2>&1
status=$?
cat "$log"
if [ $status -eq 0 ]; then
    record PASS "nccl_all_reduce: $(grep 'Avg bus bandwidth' "$log")"
else
    record FAIL "nccl_all_reduce (exit $status$([ $status -eq 124 ] && echo ', timed out'); $log)"
fi

# 6. The command line as a torchrun user checks NCCL: one process per visible GPU (at least one, so a
#    machine without one reports the probe's reason, exit 2), each checking its collectives on its device.
count_gpus() {
    if [ -n "${CUDA_VISIBLE_DEVICES:-}" ]; then
        tr ',' '\n' <<<"$CUDA_VISIBLE_DEVICES" | grep -c .
    elif command -v nvidia-smi >/dev/null; then
        nvidia-smi -L 2>/dev/null | grep -c '^GPU'
    else
        find /dev -maxdepth 1 -regex '/dev/nvidia[0-9]+' 2>/dev/null | grep -c .
    fi
}
gpus=$(count_gpus)
[ "${gpus:-0}" -ge 1 ] 2>/dev/null || gpus=1
log=target/gpu-check/selftest.log
NCCL_DEBUG=${NCCL_DEBUG:-WARN} timeout "$STEP_TIMEOUT" \
    "$BIN/chorus" launch --nproc-per-node "$gpus" -- "$BIN/chorus" selftest --backend nccl >"$log" 2>&1
status=$?
grep -E 'selftest nccl ok|chorus launch:|chorus: |skipped' "$log" | tail -n 20
if [ $status -eq 0 ]; then
    record PASS "chorus selftest --backend nccl: $(grep -c 'selftest nccl ok' "$log") of $gpus rank(s) ok"
else
    record FAIL "chorus selftest --backend nccl on $gpus GPU(s) (exit $status$([ $status -eq 124 ] && echo ', timed out'); $log)"
fi

finish
