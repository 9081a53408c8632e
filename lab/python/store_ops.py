"""Drives every TCPStore operation from PyTorch's own client and prints a
JSON transcript of the results, so a chorus server and PyTorch's server can
be compared answer for answer.

usage: store_ops.py HOST PORT
"""
import json
import sys
from datetime import timedelta

import torch.distributed as dist


def attempt(fn):
    try:
        value = fn()
    except Exception as e:  # the transcript records which calls fail, and how
        return {"error": type(e).__name__}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, (list, tuple)):
        return {"list": [v.hex() if isinstance(v, bytes) else v for v in value]}
    return {"value": value}


def main():
    host, port = sys.argv[1], int(sys.argv[2])
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
    short = timedelta(milliseconds=300)
    steps = []

    def step(name, fn):
        steps.append([name, attempt(fn)])

    step("set", lambda: store.set("k", "v"))
    step("get", lambda: store.get("k"))
    step("add fresh", lambda: store.add("n", 5))
    step("add again", lambda: store.add("n", -7))
    step("get counter", lambda: store.get("n"))
    step("compare_set missing, expected non-empty", lambda: store.compare_set("cs", "x", "y"))
    step("check after lying compare_set", lambda: store.check(["cs"]))
    step("compare_set missing, expected empty", lambda: store.compare_set("cs", "", "y"))
    step("compare_set mismatch", lambda: store.compare_set("cs", "nope", "z"))
    step("compare_set match", lambda: store.compare_set("cs", "y", "z"))
    step("append new", lambda: store.append("ap", "ab"))
    step("append existing", lambda: store.append("ap", "cd"))
    step("get appended", lambda: store.get("ap"))
    step("multi_set", lambda: store.multi_set(["m1", "m2"], ["x", ""]))
    step("multi_get", lambda: store.multi_get(["m1", "m2"]))
    step("check present", lambda: store.check(["k", "m1"]))
    step("check missing", lambda: store.check(["k", "absent"]))
    step("num_keys", lambda: store.num_keys())
    step("delete present", lambda: store.delete_key("k"))
    step("delete absent", lambda: store.delete_key("k"))
    step("num_keys after delete", lambda: store.num_keys())
    step("wait present", lambda: store.wait(["n"], short))
    step("wait timeout", lambda: store.wait(["never"], short))
    step("add after wait timeout", lambda: store.add("n", 1))
    store.set_timeout(short)
    step("get missing times out", lambda: store.get("never"))
    store.set_timeout(timedelta(seconds=10))
    step("queue_push", lambda: store.queue_push("q", "first"))
    step("queue_push 2", lambda: store.queue_push("q", b"second"))
    step("queue_len", lambda: store.queue_len("q"))
    step("check queue", lambda: store.check(["q"]))
    step("wait queue", lambda: store.wait(["q"], short))
    step("queue_pop", lambda: store.queue_pop("q"))
    step("queue_pop nonblocking", lambda: store.queue_pop("q", block=False))
    step("queue_pop empty nonblocking", lambda: store.queue_pop("q", block=False))
    step("queue_len empty", lambda: store.queue_len("q"))
    step("list_keys", lambda: sorted(store.list_keys()))
    step("set big", lambda: store.set("big", b"\x07" * (1 << 20)))
    step("get big length", lambda: len(store.get("big")))
    step("barrier of one", lambda: store.barrier("b", 1, short) if hasattr(store, "barrier") else "no barrier")
    prefixed = dist.PrefixStore("job", store)
    step("prefix set", lambda: prefixed.set("k", "pv"))
    step("prefix get through base", lambda: store.get("job/k"))
    # The server closes the connection of a refused request; keep this last.
    step("add on text", lambda: store.add("ap", 1))
    fresh = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=10))
    step("server still serves a new client", lambda: fresh.get("m1"))
    print(json.dumps(steps))


if __name__ == "__main__":
    main()
