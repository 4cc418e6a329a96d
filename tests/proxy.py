"""A TCP proxy for the control connection, to fail it in ways a process kill cannot: cut
after N frames, or rewrite one message the sender sends. It counts the connections it
carries, so a test can tell a receiver that stayed connected from one that reconnected."""

import socket
import threading
from collections.abc import Callable
from typing import Any

import msgpack

Rewrite = Callable[[dict[str, Any]], dict[str, Any] | None]


class ControlProxy:
    """Forwards receiver <-> sender frames (4-byte length, msgpack body: the control plane's
    framing). ``cut_after``: the first connection is cut after that many frames from the
    sender. ``rewrite``: called with every message from the sender; the first time it returns
    a dict, that dict goes instead (once: later messages pass untouched)."""

    def __init__(self, target: str, cut_after: int | None = None, rewrite: Rewrite | None = None) -> None:
        self.target = target
        self.cut_after = cut_after
        self.rewrite = rewrite
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.connections = 0
        self.cut = threading.Event()
        self.rewritten = threading.Event()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.connections += 1
            host, port = self.target.rsplit(":", 1)
            upstream = socket.create_connection((host, int(port)))
            first = self.connections == 1
            threading.Thread(target=self._pump, args=(client, upstream, None, False), daemon=True).start()
            threading.Thread(
                target=self._pump,
                args=(upstream, client, self.cut_after if first else None, True),
                daemon=True,
            ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, cut_after: int | None, from_sender: bool) -> None:
        frames = 0
        try:
            while True:
                header = src.recv(4, socket.MSG_WAITALL)
                if len(header) < 4:
                    break
                body = src.recv(int.from_bytes(header, "big"), socket.MSG_WAITALL)
                if from_sender and self.rewrite is not None and not self.rewritten.is_set():
                    changed = self.rewrite(msgpack.unpackb(body, raw=False))
                    if changed is not None:
                        self.rewritten.set()
                        body = msgpack.packb(changed, use_bin_type=True)
                        header = len(body).to_bytes(4, "big")
                dst.sendall(header + body)
                frames += 1
                if cut_after is not None and frames >= cut_after:
                    self.cut.set()
                    break
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()

    def close(self) -> None:
        self.listener.close()
