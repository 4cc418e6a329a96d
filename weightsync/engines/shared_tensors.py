"""``share_tensors``: the trainer's host tensors moved into memory that ``backend=ipc``
receivers map, and the registry that tells, per sync, which shared region a tensor lives in.

It is weightsync's own registry, not torch's ``share_memory_()``: torch hands a storage's
descriptor out only through a private call, and the registry lets the sender tell, per
sync, which storage a tensor lives in now. The storages of one ``share_tensors`` call
share one anonymous ``memfd`` (an arena: no name in ``/dev/shm``, so a container's small
``/dev/shm`` does not bound it; freed when the last process holding it goes), each on its
own page-aligned range (a region), which is what a receiver maps.
"""

from __future__ import annotations

import itertools
import mmap
import os
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

_ids = itertools.count(1)  # region ids: never reused in a process


def new_region_id() -> int:
    """A region id no other region of this process had or will have (``ipc`` numbers its
    staging ring and device regions from the same count as the shared ones)."""
    return next(_ids)


@dataclass
class _Arena:
    """One memfd holding the storages one ``share_tensors`` call moved (page-aligned)."""

    fd: int
    memory: weakref.ref  # its mapping; dead once every storage in it was freed


@dataclass
class _Region:
    """One storage in an arena: what a receiver maps (``offset`` is page-aligned)."""

    id: int
    arena: _Arena
    offset: int
    nbytes: int


_regions: dict[int, _Region] = {}  # by the address of the storage's first byte
_lock = threading.Lock()

T = TypeVar("T")


def _forget(arena: _Arena) -> None:
    with _lock:
        for address in [a for a, r in _regions.items() if r.arena is arena]:
            del _regions[address]
    os.close(arena.fd)


def shared_region(tensor: torch.Tensor) -> tuple[_Region, int] | None:
    """The region ``tensor``'s storage is and the tensor's byte offset in it, or None (not
    shared by ``share_tensors``, or its storage was re-allocated since)."""
    if tensor.device.type != "cpu":
        return None
    storage = tensor.untyped_storage()
    with _lock:
        region = _regions.get(storage.data_ptr())
    if region is None or region.arena.memory() is None or storage.nbytes() != region.nbytes:
        return None
    return region, tensor.data_ptr() - storage.data_ptr()


def share_tensors(obj: T) -> T:
    """Move the host tensors of ``obj`` (an ``nn.Module``'s parameters and buffers, or a
    mapping of tensors) into shared memory that ``backend=ipc`` receivers map, in place:
    each tensor keeps its identity (``tensor.data`` is swapped, as ``Module.share_memory()``
    does), tensors viewing one storage (tied weights) still view one. Already shared
    storages and device tensors (shared by CUDA IPC as they are) are left alone. Returns
    ``obj``. Call it again after replacing a parameter: the new storage is moved then.

    The storages of one call share one memfd (one descriptor in the trainer, however many
    tensors); its memory is returned when the last of them is freed."""
    if isinstance(obj, torch.nn.Module):
        tensors = [*obj.parameters(), *obj.buffers()]
    elif isinstance(obj, Mapping):
        tensors = [t for t in obj.values() if isinstance(t, torch.Tensor)]
    else:
        raise TypeError(f"share_tensors takes an nn.Module or a mapping of tensors, not {type(obj).__name__}")
    todo = [
        t for t in tensors if t.device.type == "cpu" and t.untyped_storage().nbytes() and not shared_region(t)
    ]
    old = {t.untyped_storage().data_ptr(): t.untyped_storage() for t in todo}
    if not old:
        return obj
    offsets, size = {}, 0
    for address, storage in old.items():
        offsets[address] = size
        size += -(-storage.nbytes() // mmap.PAGESIZE) * mmap.PAGESIZE
    fd = os.memfd_create("weightsync-ipc", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        memory = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
    except BaseException:
        os.close(fd)
        raise
    arena = _Arena(fd, weakref.ref(memory))
    weakref.finalize(memory, _forget, arena)
    moved: dict[int, torch.UntypedStorage] = {}
    for address, storage in old.items():
        # each storage its own view of the arena, keeping the mapping alive while it lives
        flat = torch.frombuffer(memory, dtype=torch.uint8, count=storage.nbytes(), offset=offsets[address])
        flat.copy_(torch.empty(0, dtype=torch.uint8).set_(storage))
        moved[address] = flat.untyped_storage()
        with _lock:
            _regions[flat.data_ptr()] = _Region(new_region_id(), arena, offsets[address], storage.nbytes())
    with torch.no_grad():
        for t in todo:
            new = moved[t.untyped_storage().data_ptr()]
            t.data = torch.empty(0, dtype=t.dtype).set_(new, t.storage_offset(), t.size(), t.stride())
    return obj
