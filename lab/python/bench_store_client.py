"""One load-generating client of examples/store_bench.rs: PyTorch's own
TCPStore client doing set/get pairs against one or more store servers.

usage: bench_store_client.py INDEX VALUE_BYTES NAME=HOST:PORT [NAME=HOST:PORT ...]

Connects to every server first (importing torch takes seconds, which must not
count), prints "ready", then for each stdin line "NAME SECONDS" runs
set(key, value) + get(key) against server NAME for SECONDS and prints
"PAIRS ELAPSED_SECONDS". Exits when stdin closes.
"""
import sys
import time
from datetime import timedelta

import torch.distributed as dist


def run(store, key, value, seconds):
    clock = time.perf_counter
    started = clock()
    deadline = started + seconds
    pairs = 0
    while True:
        store.set(key, value)
        got = store.get(key)
        pairs += 1
        if clock() >= deadline:
            break
    # One check per run, outside the loop: a wrong value means a broken server.
    if got != value:
        raise SystemExit(f"get returned {len(got)} bytes, not the {len(value)} set")
    return pairs, clock() - started


def main():
    index, value_bytes = int(sys.argv[1]), int(sys.argv[2])
    stores = {}
    for spec in sys.argv[3:]:
        name, addr = spec.split("=", 1)
        host, port = addr.rsplit(":", 1)
        stores[name] = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=60))
    key = f"bench/py/{index}"
    value = bytes([index % 256]) * value_bytes
    print("ready", flush=True)
    for line in sys.stdin:
        name, seconds = line.split()
        pairs, elapsed = run(stores[name], key, value, float(seconds))
        print(pairs, elapsed, flush=True)


if __name__ == "__main__":
    main()
