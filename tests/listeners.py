"""The TCP sockets a process listens on, read from /proc (no ``ss`` needed).

``/proc/PID/net/tcp`` and ``tcp6`` list every socket of the process's network namespace;
those whose inode is among the process's open descriptors (``/proc/PID/fd``) are its own.
"""

from __future__ import annotations

import os
import socket

#: addresses that mean "every interface"
WILDCARDS = ("0.0.0.0", "::")
_LISTEN = "0A"


def _decode(field: str) -> tuple[str, int]:
    """``0100007F:1F90`` -> ``("127.0.0.1", 8080)``; IPv6 likewise (four host-order words)."""
    ip_hex, port_hex = field.split(":")
    raw = bytes.fromhex(ip_hex)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, words), int(port_hex, 16)


def listening_sockets(pid: int | str = "self") -> list[tuple[str, int, int]]:
    """``(address, port, inode)`` of every listening TCP socket in ``pid``'s network namespace."""
    rows = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == _LISTEN:
                address, port = _decode(fields[1])
                rows.append((address, port, int(fields[9])))
    return rows


def _socket_inodes(pid: int | str) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def listeners_of(pid: int | str = "self") -> list[tuple[str, int]]:
    """``(address, port)`` of every TCP socket process ``pid`` listens on."""
    own = _socket_inodes(pid)
    return sorted({(address, port) for address, port, inode in listening_sockets(pid) if inode in own})


def wildcards(listeners: list[tuple[str, int]]) -> list[tuple[str, int]]:
    return [(address, port) for address, port in listeners if address in WILDCARDS]
