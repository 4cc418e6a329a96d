"""Files and processes on a directory several hosts share: atomic JSON, durable renames,
and telling whether the process that left a file is still alive (for ``engines/disk.py``)."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
from pathlib import Path
from typing import Any


def identity() -> dict[str, Any]:
    """Who this process is, precisely enough for another process to tell if it is alive."""
    try:  # pids are only comparable inside one pid namespace (containers share hostnames)
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = None
    return {"pid": os.getpid(), "host": socket.gethostname(), "pidns": pidns}


def alive(who: Any) -> bool | None:
    """Whether the process ``who`` (an ``identity``) still runs; None when this process
    cannot tell (another host or pid namespace)."""
    if not isinstance(who, dict) or not isinstance(who.get("pid"), int):
        return None
    me = identity()
    if me["pidns"] is None or who.get("host") != me["host"] or who.get("pidns") != me["pidns"]:
        return None
    try:
        os.kill(who["pid"], 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    try:  # a dead child not yet reaped by its parent (the sender may be that parent) is a zombie
        with open(f"/proc/{who['pid']}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def fsync(path: Path) -> None:
    """Make a file's bytes, or a directory's entries (new files, renames), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: Path, obj: Any, *, durable: bool) -> None:
    """Write JSON so that readers see the old file or the whole new one, never a part."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or None if it is absent or not (yet) valid JSON."""
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError, UnicodeDecodeError):
        return None


def remove_tree(path: Path) -> None:
    shutil.rmtree(path, ignore_errors=True)
