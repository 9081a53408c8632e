# chorus launch's fork server (`python - chorus-fork-server`, this program on
# stdin; see fork_server.rs).
#
# It imports what a PyTorch worker imports first (torch, and what a first
# optimizer step imports), checks that it is still one thread (fork copies
# only the calling thread: a pool started before it would be missing in
# the child), and then forks a replacement worker per request. The child
# becomes the worker a fresh `python -u script.py` would be: its own
# process group, the worker's stdio, environment, directory, CPUs and argv;
# then it runs the script as __main__. The parent reports each child's pid
# and, through a pidfd, its wait status.
#
# Protocol on the socket at CHORUS_FORK_SERVER_FD, one line per message:
#   to the launcher: "ready" | "unsafe <threads>" | "forked <id> <pid>" |
#                    "failed <id> <why>" | "exited <pid> <wait status>"
#   from it: a JSON request {"id", "argv", "env", "cwd", "cpus", "unbuffered",
#            "module"} with the child's stdout and stderr as SCM_RIGHTS.
import importlib
import json
import os
import select
import socket
import sys

PRELOAD = ("torch", "torch.distributed", "torch._dynamo", "torch.optim", "chorus.torch")
MAX_REQUEST = 1 << 20


def serve(sock):
    """Forks a worker per request; returns the request in the child only."""
    children = {}  # pidfd -> pid
    buffered, received = b"", []
    while True:
        readable, _, _ = select.select([sock, *children], [], [])
        for fd in readable:
            if fd is not sock:
                pid = children.pop(fd)
                _, status = os.waitpid(pid, 0)
                os.close(fd)
                sock.sendall(f"exited {pid} {status}\n".encode())
                continue
            data, fds, _, _ = socket.recv_fds(sock, MAX_REQUEST, 2)
            if not data:
                sys.exit(0)  # the launcher is gone
            buffered += data
            received += fds
            if not buffered.endswith(b"\n"):
                continue  # the rest of the request is on its way
            request, buffered = json.loads(buffered), b""
            fds, received = received, []
            try:
                if len(fds) != 2:
                    raise OSError(f"expected 2 descriptors, got {len(fds)}")
                pid = os.fork()
            except OSError as error:
                sock.sendall(f"failed {request['id']} {error}\n".encode())
                for fd in fds:
                    os.close(fd)
                continue
            if pid == 0:
                sock.close()
                for pidfd in children:
                    os.close(pidfd)
                return request, fds
            # Set on both sides of the fork, so the launcher can signal the
            # group as soon as it learns the pid.
            try:
                os.setpgid(pid, pid)
            except OSError:
                pass  # the child did it first, or already exec'd/exited
            children[os.pidfd_open(pid)] = pid
            for fd in fds:
                os.close(fd)
            sock.sendall(f"forked {request['id']} {pid}\n".encode())


def become(request, fds, server):
    """Turns this forked child into the worker the request describes."""
    os.setpgid(0, 0)
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    if libc.prctl(pr_set_pdeathsig, 9) != 0 or os.getppid() != server:
        os._exit(1)  # no parent to outlive: die as a worker of a dead launcher would
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(fds[0], 1)
    os.dup2(fds[1], 2)
    for fd in (null, *fds):
        if fd > 2:
            os.close(fd)
    if request["cpus"]:
        os.sched_setaffinity(0, request["cpus"])
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:
        # A fresh interpreter seeds numpy's global generator from the OS;
        # a forked one would repeat the server's sequence.
        sys.modules["numpy"].random.seed()
    reopen_stdio(request["unbuffered"])
    argv = request["argv"]
    if request["module"]:
        sys.argv = ["-m", *argv[1:]]
        sys.path[0] = os.getcwd()
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))


def reopen_stdio(unbuffered):
    """The standard streams as a fresh interpreter opens them (`-u` or not)."""
    import io

    def text(fd, mode, errors, line_buffering=False):
        if mode == "r":
            raw = io.FileIO(fd, "r", closefd=False)
            return io.TextIOWrapper(io.BufferedReader(raw), errors=errors)
        raw = io.FileIO(fd, "w", closefd=False)
        if unbuffered:
            return io.TextIOWrapper(raw, errors=errors, write_through=True)
        return io.TextIOWrapper(io.BufferedWriter(raw), errors=errors, line_buffering=line_buffering)

    sys.stdin = sys.__stdin__ = text(0, "r", "strict")
    sys.stdout = sys.__stdout__ = text(1, "w", "strict")
    sys.stderr = sys.__stderr__ = text(2, "w", "backslashreplace", line_buffering=True)


def main():
    sock = socket.socket(fileno=int(os.environ.pop("CHORUS_FORK_SERVER_FD")))
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - what is missing is imported by the worker itself
            pass
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        sock.sendall(f"unsafe {threads}\n".encode())
        return None
    sock.sendall(b"ready\n")
    server = os.getpid()
    request, fds = serve(sock)
    become(request, fds, server)
    return request


request = main()
if request is not None:
    import runpy

    if request["module"]:
        runpy.run_module(request["argv"][0], run_name="__main__", alter_sys=True)
    else:
        runpy.run_path(request["argv"][0], run_name="__main__")
