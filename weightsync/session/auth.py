"""Peer authentication in the handshake: HMAC-SHA256 over fresh nonces.

Both sides prove they hold the shared secret without sending it: the sender challenges
with a nonce, the receiver answers with a MAC over both nonces and what it claims (rank,
backend), and the sender proves itself back with a MAC in the other direction. Fresh
nonces on both sides make a recorded answer useless later.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets

NONCE_BYTES = 32


def new_nonce() -> bytes:
    return secrets.token_bytes(NONCE_BYTES)


def mac(secret: bytes, label: str, *parts: bytes | str | int) -> bytes:
    """MAC of ``label`` and ``parts``, each length-prefixed so no two part lists collide."""
    h = hmac.new(secret, digestmod=hashlib.sha256)
    for part in (label, *parts):
        data = part if isinstance(part, bytes) else str(part).encode()
        h.update(len(data).to_bytes(4, "big") + data)
    return h.digest()


def verify(secret: bytes, tag: object, label: str, *parts: bytes | str | int) -> bool:
    """Constant-time check of a received ``tag`` (any type: it came off the wire)."""
    return isinstance(tag, bytes) and hmac.compare_digest(tag, mac(secret, label, *parts))


def reachable_from_other_hosts(host: str) -> bool:
    """Whether a socket bound to ``host`` (an address, as the socket reports it) accepts
    connections from other hosts: anything but a loopback address (a wildcard does)."""
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return host != "localhost"
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not ip.is_loopback
