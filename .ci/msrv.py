#!/usr/bin/env python3
"""Checks the `rust-version` the workspace states against what it builds
with: every crate in the normal and build dependency tree of the workspace
members must state a rust-version no newer (a crate stating none passes).
CI runs `cargo +<msrv> check` as well where that toolchain is installed;
this check needs no toolchain download."""
import json
import subprocess
import sys


def version(text):
    return tuple(int(part) for part in text.split("."))


meta = json.loads(subprocess.run(
    ["cargo", "metadata", "--format-version", "1", "--locked"],
    check=True, capture_output=True, text=True).stdout)
packages = {p["id"]: p for p in meta["packages"]}
nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}
members = meta["workspace_members"]
msrv = {packages[m]["rust_version"] for m in members}
if len(msrv) != 1 or None in msrv:
    sys.exit(f"msrv: every workspace crate must state one rust-version, found {sorted(map(str, msrv))}")
msrv = msrv.pop()

seen, todo = set(), list(members)
while todo:
    pid = todo.pop()
    if pid in seen:
        continue
    seen.add(pid)
    for dep in nodes[pid]["deps"]:
        if any(k["kind"] in (None, "build") for k in dep["dep_kinds"]):
            todo.append(dep["pkg"])

newer = sorted(
    f"{packages[p]['name']} {packages[p]['version']} needs Rust {packages[p]['rust_version']}"
    for p in seen
    if packages[p]["rust_version"] and version(packages[p]["rust_version"]) > version(msrv))
if newer:
    sys.exit(f"msrv: rust-version {msrv} is stated, but:\n  " + "\n  ".join(newer)
             + "\nraise rust-version in Cargo.toml or pin older versions")
print(f"msrv: {len(seen)} crates in the normal dependency tree, none needs more than Rust {msrv}")
