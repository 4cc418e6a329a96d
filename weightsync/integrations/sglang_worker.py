"""SGLang replicas as weightsync receivers: the worker side (runs in SGLang's scheduler
processes, one per TP rank).

The way in is SGLang's own custom weight loader: an engine started with
``custom_weight_loader=[LOADER]`` lets ``update_weights_from_tensor(named_tensors,
load_format=LOADER)`` call ``weightsync_loader(model, named_tensors)`` in every TP worker,
between SGLang's ``begin_weight_update()`` and ``end_weight_update()``, and flushes its
cache after it (the returned flag says whether it could). Why this point rather than the
others SGLang offers:

- ``update_weights_from_distributed`` receives through a ``torch.distributed`` group that
  SGLang forms and drives (one broadcast per tensor list, from rank 0): weightsync's
  transports (shm, Mooncake, paired routes, deltas, deadlines that name a peer) would not
  be in the path.
- ``update_weights_from_tensor`` with SGLang's own formats ships the tensors themselves
  through its control socket (pickled per TP rank): every byte would cross SGLang's IPC.
- A custom loader gets the running model and nothing else: the ``named_tensors`` carry one
  small command (its name is JSON: ``init``, ``receive``, ``close``), and the tensors come
  through the weightsync session into ``model.load_weights`` (SGLang's own: q/k/v and
  gate/up fusion, TP slicing).

The loader must not raise (SGLang 0.5.23 does not catch it: the scheduler would die), so
each worker writes its status (``ReplicaReceiver.status()``, JSON) to
``<status_dir>/<tp_rank>.json`` after every command, where the trainer side
(``weightsync.integrations.sglang``) reads it.

Never silent: SGLang's loaders skip names they do not know (``Qwen2Model.load_weights``
ignores any name not among its parameters) and return what they wrote.
``checked_load`` fails the update naming every tensor of which nothing was copied into the
model, and (a full version) every parameter nothing was written to.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from weightsync.integrations.replicas.receiver import NotTaken, ReplicaReceiver, tensor_digests

log = logging.getLogger("weightsync.sglang")

#: The import path SGLang is started with (``custom_weight_loader=[LOADER]``) and every
#: command names as its ``load_format``.
LOADER = "weightsync.integrations.sglang_worker.weightsync_loader"

#: this process's receiver (one SGLang scheduler process is one TP worker)
_STATE: ReplicaReceiver | None = None


def _listed(names: Iterable[str], limit: int = 8) -> str:
    names = sorted(names)
    more = f", ... ({len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


class _Writes(TorchDispatchMode):
    """In-place writes on this thread while active: how many elements were written, and
    into which parameters (by storage). Dispatch modes are per thread: the receiving thread's
    copies into landing memory are not seen."""

    def __init__(self, owners: dict[int, list[str]]) -> None:
        super().__init__()
        self.owners = owners
        self.numel = 0
        self.params: set[str] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        # copy_, and any other in-place write (index_put_, fill_, ...: an overload whose
        # name ends in "_" writes its first argument)
        if args and isinstance(args[0], torch.Tensor) and func.overloadpacket.__name__.endswith("_"):
            dst = args[0]
            self.numel += dst.numel()
            self.params.update(self.owners.get(dst.untyped_storage().data_ptr(), ()))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def checked_load(model: torch.nn.Module, *, where: str, partial: bool = False) -> Iterator[Any]:
    """Around one ``model.load_weights(weights)`` of SGLang: yields a wrapper for the
    weights iterator; after the load, raises ``NotTaken`` naming each tensor of which the
    loader copied nothing into the model, and (unless ``partial``) each parameter nothing
    was written to. A loader that raises fails naming the tensor it was loading.

    Loaders consume the iterator one item at a time, so what is copied between handing out
    an item and being asked for the next is that item's doing (a loader that buffered items
    would be refused: fail closed, never a guess)."""
    owners: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(param.untyped_storage().data_ptr(), []).append(name)
    writes = _Writes(owners)
    untaken: list[str] = []
    current: list[str | None] = [None]

    def watched(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            current[0] = name
            before = writes.numel
            yield name, tensor
            if writes.numel == before:
                untaken.append(name)
            current[0] = None

    try:
        with writes:
            yield watched
    except NotTaken:
        raise
    except Exception as e:
        if current[0] is None:
            raise
        raise NotTaken(
            f"{where}: SGLang's loader failed on tensor {current[0]!r}: {type(e).__name__}: {e}"
        ) from e
    problems = []
    if untaken:
        problems.append(f"it took nothing of {len(untaken)} tensor(s): {_listed(untaken)}")
    missing = {names[0] for names in owners.values() if names[0] not in writes.params}
    if not partial and missing:
        problems.append(
            f"the full version left {len(missing)} of its {len(owners)} parameter(s) unwritten: "
            f"{_listed(missing)} (an update that leaves parameters as they are must say partial=True)"
        )
    if problems:
        raise NotTaken(f"{where}: SGLang did not take the update: " + "; ".join(problems))


def _tp_rank() -> int:
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


def _write_status(status_dir: str, rank: int, status: dict[str, Any]) -> None:
    path = os.path.join(status_dir, f"{rank}.json")
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(status, f, default=str)
    os.replace(tmp, path)  # the reader never sees half a file


def weightsync_loader(model: torch.nn.Module, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """SGLang's custom weight loader (``load_format=LOADER``): run the command carried in the
    one name of ``named_tensors`` in this TP worker, and write this worker's status. Never
    raises: a failure is in the status (``ok``, ``error``) that the trainer side reads."""
    global _STATE
    rank = _tp_rank()
    (command,) = [json.loads(name) for name, _ in named_tensors]
    op, args, status_dir = command["op"], command.get("args", {}), command["status_dir"]
    if _STATE is None:
        _STATE = ReplicaReceiver()
    state = _STATE
    status: dict[str, Any]
    try:
        if op == "init":
            status = state.open(
                args["address"], args["rank_offset"] + rank, args["overrides"], args["warm_up"]
            )
        elif op == "receive":
            where = f"TP rank {rank} (receiver rank {args['rank_offset'] + rank})"
            partial = bool(args.get("partial", False))

            def reload(weights: Iterable[tuple[str, torch.Tensor]]) -> None:
                with checked_load(model, where=where, partial=partial) as watch:
                    model.load_weights(watch(weights))

            status = state.receive(int(args["version"]), reload)
        elif op == "close":
            state.close()
            status = state.status()
        elif op == "status":
            status = state.status()
        elif op == "digests":  # the bytes this worker serves, to compare with a reference load
            status = {**state.status(), "digests": tensor_digests(model)}
        else:
            status = {**state.status(), "ok": False, "error": f"unknown weightsync command {op!r}"}
    except Exception as e:  # SGLang would not survive it: reported instead
        log.exception("weightsync: command %s failed", op)
        status = {**state.status(), "ok": False, "error": f"{type(e).__name__}: {e}"}
    status["tp_rank"] = rank
    status["written_at"] = time.time()
    _write_status(status_dir, rank, status)
