"""Starting and stopping the child processes of the multi-process tests.

Children start from a fork server that imported torch, weightsync and the tests' worker
modules once (``weightsync.platform.process_context``): real processes, each with the
caller's environment of the moment it starts, without a fresh interpreter's 1.2-1.4 s of
imports each.
"""

import os

from weightsync.platform import free_port, process_context, start_process  # noqa: F401 (tests take free_port from here)

CTX = process_context(["workers", "weightsync.sender.sender", "weightsync.receiver.receiver"])


def start(target, *args):
    return start_process(CTX, target, *args)


def collect(q, n, timeout=90):
    return [q.get(timeout=timeout) for _ in range(n)]


def stop(procs):
    for p in procs:  # only the children this test started
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a killed child of another process lingers as a zombie
    until reaped: that is not running)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False
