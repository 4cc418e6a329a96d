"""A third-party backend in one file: ``tcp``, a minimal transport over plain TCP.

It shows the whole contract of ``weightsync.engines.base.Transport``: the sender listens
on the session's interface and tells receivers where in ``prepare``; every receiver
connects in ``connect``; ``send_buckets`` writes each bucket's bytes to every receiver,
``recv_buckets`` reads them into one buffer. The session does everything else (handshake,
plan, acknowledgements, deadlines). Loaded by ``custom_backend_module=tcp_transport``.
"""

import secrets
import socket
import struct

import torch

from weightsync import register_engine
from weightsync.engines.base import Transport

_HELLO = struct.Struct("<16sq")  # (token, group rank)


class TcpTransport(Transport):
    name = "tcp"

    def __init__(self, config, device):
        super().__init__(config, device)
        self.listener = None
        self.token = b""
        self.peers = []  # sender: one socket per receiver; receiver: the sender's
        self.key = None

    def prepare(self, join):
        if self.listener is None:
            self.listener = socket.create_server((join.local_host or "127.0.0.1", 0))
        if not self.peers:  # a new group: a new token, so every receiver connects anew
            self.token = secrets.token_bytes(16)  # travels over the authenticated session
        return {"port": self.listener.getsockname()[1], "token": self.token.hex()}

    def connect(self, join, info):
        key = (info["port"], info["token"], join.world_size)
        if key == self.key:
            return
        self._leave()
        if join.rank == 0:
            self.listener.settimeout(self.config.timeout_s)
            while len(self.peers) < join.world_size - 1:
                sock, _ = self.listener.accept()
                token, _rank = _HELLO.unpack(sock.recv(_HELLO.size, socket.MSG_WAITALL))
                if token != self.token:
                    sock.close()  # not one of ours
                    continue
                self.peers.append(sock)
        else:
            sock = socket.create_connection((join.sender_host, info["port"]), timeout=self.config.timeout_s)
            sock.sendall(_HELLO.pack(bytes.fromhex(info["token"]), join.rank))
            self.peers = [sock]
        self.key = key

    def send_buckets(self, produce):
        buffer = torch.empty(self.config.bucket_bytes, dtype=torch.uint8)
        sent = 0
        while (produced := produce(buffer)) is not None:
            bucket, payload = produced
            data = payload.contiguous().numpy().tobytes()
            for sock in self.peers:
                sock.sendall(data)
            sent += bucket.nbytes
        return sent

    def recv_buckets(self, next_bucket, landing=None):
        buffer = torch.empty(self.config.bucket_bytes, dtype=torch.uint8)
        view = memoryview(buffer.numpy())
        while (bucket := next_bucket()) is not None:
            got = 0
            while got < bucket.nbytes:
                n = self.peers[0].recv_into(view[got : bucket.nbytes])
                if n == 0:
                    raise ConnectionError("the sender closed its connection")
                got += n
            yield bucket, buffer[: bucket.nbytes]

    def finish(self, ok):
        if not ok:
            self._leave()

    def reset(self):
        self._leave()

    def close(self):
        self._leave()
        if self.listener is not None:
            self.listener.close()
            self.listener = None

    def _leave(self):
        for sock in self.peers:
            sock.close()
        self.peers = []
        self.key = None


register_engine("tcp", TcpTransport)
