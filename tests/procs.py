"""Starting and stopping the child processes of the multi-process tests."""

import multiprocessing as mp
import socket

CTX = mp.get_context("spawn")


def start(target, *args):
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def collect(q, n, timeout=90):
    return [q.get(timeout=timeout) for _ in range(n)]


def stop(procs):
    for p in procs:  # only the children this test started
        p.join(timeout=20)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
