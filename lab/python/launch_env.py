"""Writes this worker's environment as JSON to DIR/<RANK>.json, so a test
can compare what torchrun and `chorus launch` give a worker.

usage: launch_env.py DIR
"""
import json
import os
import sys


def main():
    path = os.path.join(sys.argv[1], os.environ["RANK"] + ".json")
    with open(path, "w") as f:
        json.dump(dict(os.environ), f, sort_keys=True)


if __name__ == "__main__":
    main()
