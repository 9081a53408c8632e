"""Runs PyTorch's own TCPStore server (libuv) on 127.0.0.1 and a free port,
prints the port, and serves until stdin closes.

usage: serve_store.py
"""
import sys
from datetime import timedelta

import torch.distributed as dist


def main():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    print(store.port, flush=True)
    sys.stdin.read()
    del store


if __name__ == "__main__":
    main()
