"""Backend ``disk``: every version published as a checkpoint in a shared directory.

The fallback any cluster with a shared file system can use, in a form every inference
engine can load by itself: a version is a Hugging Face style checkpoint (safetensors
shards of about ``bucket_bytes``, ``model.safetensors.index.json``) plus our manifest
``weightsync.json``. There is no control session: the sender writes, receivers poll the
directory, and their acknowledgements come back as small files.

Layout of ``engine_kwargs.disk.path``::

    v000000000007/                    a published version: complete, never modified
        model-00001-of-00002.safetensors
        model-00002-of-00002.safetensors
        model.safetensors.index.json
        weightsync.json
    .tmp-v8-<token>/                  a version being written (receivers never look here)
    .trash-v5-<token>/                a pruned version being deleted
    acks/v000000000007.rank0.json     receiver 0's answer for version 7

Publishing is atomic: the writer fills a temporary directory, fsyncs the files and the
directory, then renames it to the version's name, so a writer that dies earlier publishes
nothing. Versions are renamed aside before they are deleted, so a reader never finds a
half-deleted one (a reader that already opened a shard keeps reading it).

Every publication carries a random ``id`` that receivers repeat in their acks: an ack
left by an earlier attempt at the same version never satisfies the wait for a later one.
Only JSON and safetensors are read; nothing is unpickled.

With a shared secret (``auth_secret`` or ``$WEIGHTSYNC_SECRET``) the sender signs each
manifest: an HMAC-SHA256 over its canonical JSON, which lists every shard's SHA-256 (of
the bytes of its tensors, in order). A receiver with the secret refuses a version whose
manifest is unsigned or wrongly signed, before reading a tensor (its state stays), and
checks each shard's digest before handing out any tensor of it, so whoever can write to
the directory without the secret can withhold versions but not substitute weights.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import struct
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from weightsync.config.engine import EngineConfig
from weightsync.config.keys import SECRET_ENV
from weightsync.engines.base import Offer, Publisher
from weightsync.engines.disk_files import alive, fsync, identity, read_json, remove_tree, write_json
from weightsync.errors import (
    HandshakeError,
    PeerLost,
    RemoteFailure,
    SyncError,
    SyncTimeout,
    VerificationError,
)
from weightsync.plan import TensorSpec, as_bytes, plan_hash
from weightsync.session import auth
from weightsync.sources import WeightSource
from weightsync.stats import SyncStats
from weightsync.verify import checksum_fn

log = logging.getLogger("weightsync")

FORMAT = 1
MANIFEST = "weightsync.json"
INDEX = "model.safetensors.index.json"
ACKS = "acks"
_WRITER = ".writer.json"  # in a temporary directory: who is writing it
_VERSION_DIR = re.compile(r"^v(\d{12,})$")
_TMP_DIR = re.compile(r"^\.tmp-v\d+-[0-9a-f]+$")
_TRASH_DIR = re.compile(r"^\.trash-v\d+-[0-9a-f]+$")
SIGNATURE = "signature"  # manifest field: HMAC-SHA256 (hex) of the rest of the manifest
_SIGNED = "weightsync-disk-manifest"  # what the HMAC says it is (never confused with a handshake MAC)
# Polling a shared directory: quick at first (a version is often already there), then at
# most 20 listings a second per process, which no file server notices.
POLL_MIN_S = 0.005
POLL_MAX_S = 0.05

# torch dtype -> safetensors dtype code (the format's own names)
_ST_DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):  # unsigned wide integers exist from torch 2.3
        _ST_DTYPES[getattr(torch, _name)] = _code


def version_dir(version: int) -> str:
    """Directory name of a published version; zero-padded so names sort like versions."""
    return f"v{version:012d}"


def ack_name(version: int, rank: int) -> str:
    return f"{version_dir(version)}.rank{rank}.json"


def published_versions(root: Path) -> list[int]:
    """Versions published in ``root``, oldest first."""
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(int(m.group(1)) for n in names if (m := _VERSION_DIR.match(n)))


# ---------------------------------------------------------------------------- helpers
def _host_tensor(tensor: torch.Tensor) -> torch.Tensor:
    t = tensor.detach()
    return t if t.device.type == "cpu" else t.cpu()


def _canonical(manifest: dict[str, Any]) -> bytes:
    """The bytes a manifest's signature covers: all of it but the signature, as canonical
    JSON (sorted keys, no spaces, ASCII)."""
    body = {k: v for k, v in manifest.items() if k != SIGNATURE}
    return json.dumps(
        body, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False
    ).encode()


def sign_manifest(secret: bytes, manifest: dict[str, Any]) -> str:
    return auth.mac(secret, _SIGNED, _canonical(manifest)).hex()


def signature_problem(secret: bytes, manifest: dict[str, Any]) -> str | None:
    """Why ``manifest`` is not signed with ``secret``, or None if it is."""
    tag = manifest.get(SIGNATURE)
    if tag is None:
        return (
            f"its manifest is not signed, and this receiver has a shared secret (auth_secret or ${SECRET_ENV}): "
            "the sender has none, or someone without it wrote this version"
        )
    try:
        ok = isinstance(tag, str) and auth.verify(secret, bytes.fromhex(tag), _SIGNED, _canonical(manifest))
    except ValueError:  # not hex, or not canonical JSON (NaN)
        ok = False
    if not ok:
        return (
            "its manifest's signature does not match: the sender holds another shared secret "
            f"(auth_secret or ${SECRET_ENV}), or the manifest was changed after it was signed"
        )
    return None


def _write_shard(
    path: Path, items: list[tuple[str, torch.Tensor]], checksum, digest: bool = False
) -> tuple[list[int | None], str | None]:
    """Write one safetensors file from ``items`` (host tensors), streaming each tensor's
    bytes from its own memory. Returns each tensor's checksum and, with ``digest``, the
    SHA-256 of all their bytes in order."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}  # transformers checks "format"
    views = []
    offset = 0
    for name, t in items:
        code = _ST_DTYPES.get(t.dtype)
        if code is None:
            raise SyncError(f"tensor {name!r}: dtype {t.dtype} cannot be stored in safetensors")
        data = as_bytes(t)
        header[name] = {
            "dtype": code,
            "shape": list(t.shape),
            "data_offsets": [offset, offset + data.numel()],
        }
        offset += data.numel()
        views.append(data)
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format's recommended alignment of the data
    sha = hashlib.sha256() if digest else None
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for data in views:
            if data.numel():
                f.write(memoryview(data.numpy()))
                if sha is not None:
                    sha.update(memoryview(data.numpy()))
    sums = [checksum(data) if checksum is not None else None for data in views]
    return sums, sha.hexdigest() if sha is not None else None


# ---------------------------------------------------------------------------- receiver view
class Publication(Offer):
    """One published version as a receiver sees it: its manifest, checked."""

    def __init__(self, publisher: DiskPublisher, rank: int, version: int, manifest: dict[str, Any]) -> None:
        self.publisher = publisher
        self.rank = rank
        root = self.root = publisher.root
        self.directory = root / version_dir(version)
        self.version = version
        self.manifest = manifest
        try:
            if manifest.get("format") != FORMAT:
                raise ValueError(
                    f"manifest format {manifest.get('format')!r}, this weightsync reads format {FORMAT}"
                )
            if manifest.get("version") != version:
                raise ValueError(f"the manifest says version {manifest.get('version')!r}")
            self.id: str = str(manifest["id"])
            self.force = manifest.get("force") is True
            self.verify: str = manifest.get("verify", "off")
            self.specs = [TensorSpec.from_wire(t) for t in manifest["tensors"]]
            bucket_bytes = manifest["bucket_bytes"]
            if plan_hash(self.specs, bucket_bytes) != manifest.get("plan_hash"):
                raise ValueError("its plan hash does not match its tensors")
            self.shards: list[dict[str, Any]] = manifest["shards"]
            self.parts = len(self.shards)
            names = [n for s in self.shards for n in s["tensors"]]
            if names != [s.name for s in self.specs]:
                raise ValueError("its shards do not hold its tensors in order")
            for s in self.shards:
                if "/" in s["file"] or s["file"].startswith("."):
                    raise ValueError(f"shard file name {s['file']!r} is not a plain name")
        except (KeyError, TypeError, ValueError) as e:
            raise SyncError(f"{self.directory / MANIFEST} is not a valid manifest: {e}") from e

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    def refusal(self, config: EngineConfig) -> str | None:
        secret = config.secret()
        if secret is not None and (problem := signature_problem(secret, self.manifest)) is not None:
            return problem
        if self.verify != config.verify:
            return f"verify: sender {self.verify!r}, receiver {config.verify!r} (set the same value on both sides)"
        return None

    def ack(self, state: str, message: str | None = None) -> None:
        """Tell the sender how this receiver is doing with this publication, in a file."""
        if state in ("ok", "failed"):
            self.publisher.last_read = (self.version, self.id)
        ack = {
            "version": self.version,
            "id": self.id,
            "rank": self.rank,
            "state": state,
            "message": message,
            "reader": identity(),
            "time": time.time(),
        }
        try:
            write_json(self.root / ACKS / ack_name(self.version, self.rank), ack, durable=False)
        except OSError as e:  # the sender then times out naming this rank; say why here
            log.warning(
                "receiver rank %d: cannot write its ack of version %d in %s: %s",
                self.rank,
                self.version,
                self.root,
                e,
            )

    def tensors(self, device: torch.device, owned: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
        """Every tensor, one shard at a time (memory: one shard). With ``verify`` on, all
        tensors of a shard are checked before the first of them is yielded. Yielded
        tensors are new (the caller may keep them, ``owned`` or not)."""
        from safetensors import SafetensorError, safe_open

        rank = self.rank
        checksum = checksum_fn(self.verify)
        # Signed (``refusal`` checked the manifest): every shard's bytes must match it too.
        signed = self.publisher.config.secret() is not None
        specs = iter(self.specs)
        for shard in self.shards:
            path = self.directory / shard["file"]
            try:
                size = path.stat().st_size
                if size != shard["bytes"]:
                    raise SyncError(f"shard {path} has {size} bytes, its manifest says {shard['bytes']}")
                with safe_open(str(path), framework="pt", device="cpu") as f:
                    loaded = [(name, f.get_tensor(name)) for name in shard["tensors"]]
            except FileNotFoundError as e:
                raise SyncError(
                    f"receiver rank {rank}: shard {path} of version {self.version} vanished while reading "
                    "(pruned or replaced by a newer publish)"
                ) from e
            except (OSError, SafetensorError) as e:
                raise SyncError(
                    f"receiver rank {rank}: reading shard {path} of version {self.version} failed: {e}"
                ) from e
            bad = []
            sha = hashlib.sha256() if signed else None
            for (name, t), expected in zip(loaded, shard.get("checksums") or [None] * len(loaded)):
                spec = next(specs)
                if TensorSpec.of(name, t) != spec:
                    raise SyncError(
                        f"shard {path}: tensor {name!r} is {TensorSpec.of(name, t)}, the manifest says {spec}"
                    )
                if checksum is not None and checksum(as_bytes(t)) != expected:
                    bad.append(name)
                if sha is not None and t.numel():
                    sha.update(memoryview(as_bytes(t).numpy()))
            signed_digest = shard.get("sha256")
            if sha is not None and not (
                isinstance(signed_digest, str) and hmac.compare_digest(sha.hexdigest(), signed_digest)
            ):
                raise VerificationError(
                    f"receiver rank {rank}: shard {shard['file']} of version {self.version} does not match the "
                    "digest its signed manifest holds: it was changed after it was published"
                )
            if bad:
                raise VerificationError(
                    f"receiver rank {rank}: version {self.version} failed verification ({self.verify}) in shard "
                    f"{shard['file']}; tensors affected: {', '.join(bad[:16])}"
                    + (f" and {len(bad) - 16} more" if len(bad) > 16 else "")
                )
            for name, t in loaded:
                yield name, t if device.type == "cpu" else t.to(device)
            del loaded


# ---------------------------------------------------------------------------- engine
class DiskPublisher(Publisher):
    """Publishes versions into ``engine_kwargs.disk.path``; receivers read them there.

    ``Sender`` calls ``publish``; ``Receiver`` calls ``offer``, reads the
    ``Publication``'s tensors and answers with its ``ack``.
    """

    name = "disk"

    def __init__(self, config: EngineConfig, device: torch.device, address: str) -> None:
        super().__init__(config, device, address)
        self.root = Path(config.engine_kwargs.disk.path)
        self.keep = config.engine_kwargs.disk.keep
        #: receivers: the publication last read, whole or not, as (version, id). A receive
        #: waits for another one, as a receive over a session waits for another send: so a
        #: retry after a failure reads the sender's new publication, never the failed one.
        self.last_read: tuple[int, str] | None = None

    # ------------------------------------------------------------------ sender
    def publish(self, source: WeightSource, version: int, receivers: Sequence[int], force: bool) -> SyncStats:
        """Write ``version`` from ``source``, publish it, prune old versions, then wait
        (``timeout_s``) until every receiver in ``receivers`` acknowledged it."""
        start = time.perf_counter()
        root = self.root
        (root / ACKS).mkdir(parents=True, exist_ok=True)
        published = published_versions(root)
        newest = published[-1] if published else None
        if newest is not None and version < newest and not force:
            raise HandshakeError(
                f"version {version} is older than version {newest}, the newest published in {root} "
                "(send it with force=True to roll back)"
            )
        self._clean_leftovers()
        token = secrets.token_hex(6)
        tmp = root / f".tmp-v{version}-{token}"
        tmp.mkdir()
        stats = SyncStats(version, receivers=len(receivers))
        try:
            write_json(tmp / _WRITER, {**identity(), "created": time.time()}, durable=False)
            secret = self.config.secret()
            specs, shards = self._write_shards(tmp, source, stats, digest=secret is not None)
            manifest = {
                "format": FORMAT,
                "version": version,
                "id": token,
                "force": force,
                "plan_hash": plan_hash(specs, self.config.bucket_bytes),
                "bucket_bytes": self.config.bucket_bytes,
                "verify": self.config.verify,
                "tensors": [s.to_wire() for s in specs],
                "shards": shards,
                "created": time.time(),
                "writer": identity(),
            }
            if secret is not None:
                manifest[SIGNATURE] = sign_manifest(secret, manifest)
            index = {
                "metadata": {"total_size": stats.bytes, "weightsync_version": version},
                "weight_map": {n: s["file"] for s in shards for n in s["tensors"]},
            }
            write_json(tmp / INDEX, index, durable=True)
            write_json(tmp / MANIFEST, manifest, durable=True)
            (tmp / _WRITER).unlink()
            fsync(tmp)
            if force:  # a rollback: versions newer than it are withdrawn first
                for v in published:
                    if v > version:
                        self._retire(v)
            if (root / version_dir(version)).exists():
                self._retire(version)  # a retry of a published version replaces it
            os.rename(tmp, root / version_dir(version))
            fsync(root)
        except BaseException:
            remove_tree(tmp)
            raise
        stats.transfer_s = time.perf_counter() - start
        log.info(
            "published version %d in %s: %d tensors, %.1f MB in %d shards",
            version,
            root,
            stats.tensors,
            stats.bytes / 1e6,
            stats.buckets,
        )
        self._prune()
        self._await_acks(version, token, receivers)
        return stats

    def _write_shards(
        self, tmp: Path, source: WeightSource, stats: SyncStats, digest: bool = False
    ) -> tuple[list[TensorSpec], list[dict[str, Any]]]:
        """Pack the source's tensors, whole, into shards of about ``bucket_bytes`` (a
        larger tensor alone in its own). Holds one shard's tensors at a time. ``digest``:
        record each shard's SHA-256 (a signed manifest covers them)."""
        checksum = checksum_fn(self.config.verify)
        limit = self.config.bucket_bytes
        specs: list[TensorSpec] = []
        shards: list[dict[str, Any]] = []
        pending: list[tuple[str, torch.Tensor]] = []
        pending_bytes = 0

        def flush() -> None:
            nonlocal pending, pending_bytes
            if not pending:
                return
            part = f"part-{len(shards):05d}"  # renamed once the number of shards is known
            sums, sha = _write_shard(tmp / part, pending, checksum, digest)
            entry: dict[str, Any] = {
                "file": part,
                "bytes": (tmp / part).stat().st_size,
                "tensors": [n for n, _ in pending],
            }
            if checksum is not None:
                entry["checksums"] = sums
            if sha is not None:
                entry["sha256"] = sha
            shards.append(entry)
            pending, pending_bytes = [], 0

        seen: set[str] = set()
        for name, tensor in source.tensors():
            if name in seen or name == "__metadata__":
                raise SyncError(f"tensor name {name!r} appears twice or is reserved")
            seen.add(name)
            t = _host_tensor(tensor)
            specs.append(TensorSpec.of(name, t))
            if pending and pending_bytes + t.nbytes > limit:
                flush()
            pending.append((name, t))
            pending_bytes += t.nbytes
            stats.tensors += 1
            stats.bytes += t.nbytes
        flush()
        for i, shard in enumerate(shards):
            final = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            os.rename(tmp / shard["file"], tmp / final)
            shard["file"] = final
        # Durable before the rename publishes them (a shared FS must hold the bytes). Once at
        # the end, not per shard: writing the next shard overlaps the previous' writeback.
        for shard in shards:
            fsync(tmp / shard["file"])
        stats.buckets = len(shards)
        return specs, shards

    def _retire(self, version: int) -> None:
        """Take a published version away at once (one rename), then delete it."""
        trash = self.root / f".trash-v{version}-{secrets.token_hex(6)}"
        try:
            os.rename(self.root / version_dir(version), trash)
        except FileNotFoundError:
            return
        remove_tree(trash)
        for ack in (self.root / ACKS).glob(f"{version_dir(version)}.rank*.json"):
            ack.unlink(missing_ok=True)

    def _prune(self) -> None:
        for v in published_versions(self.root)[: -self.keep]:
            self._retire(v)

    def _clean_leftovers(self) -> None:
        """Delete what dead writers left: temporary directories whose writer is known to
        be gone (same host and pid namespace), and trash an interrupted prune left. A
        temporary directory of a writer this process cannot check is left alone."""
        for entry in os.scandir(self.root):
            path = Path(entry.path)
            if _TRASH_DIR.match(entry.name):
                remove_tree(path)
            elif _TMP_DIR.match(entry.name) and alive(read_json(path / _WRITER)) is False:
                log.info("removing %s, left by a writer that died before publishing it", path)
                remove_tree(path)

    def _await_acks(self, version: int, token: str, receivers: list[int]) -> None:
        """Wait for every receiver's ack of this publication; raise naming those that
        failed, refused, died or did not answer in time."""
        timeout = self.config.timeout_s
        end = time.monotonic() + timeout
        pending = set(receivers)
        final: dict[int, dict[str, Any]] = {}
        reading: dict[int, dict[str, Any]] = {}
        poll = POLL_MIN_S
        while pending:
            for rank in sorted(pending):
                ack = read_json(self.root / ACKS / ack_name(version, rank))
                if not isinstance(ack, dict) or ack.get("id") != token:
                    continue  # none yet, or left by an earlier publication
                state = ack.get("state")
                if state in ("ok", "failed", "refused"):
                    final[rank] = ack
                elif state == "reading":
                    reading[rank] = ack
                    if alive(ack.get("reader")) is False:
                        final[rank] = {**ack, "state": "lost"}
            pending -= set(final)
            if not pending or time.monotonic() >= end:
                break
            time.sleep(poll)
            poll = min(poll * 2, POLL_MAX_S)
        problems: dict[str, dict[int, str]] = {"lost": {}, "timeout": {}, "refused": {}, "failed": {}}
        for rank in sorted(pending):
            who = (reading.get(rank) or {}).get("reader") or {}
            problems["timeout"][rank] = (
                f"receiver rank {rank} started reading version {version} (pid {who.get('pid')} on {who.get('host')}) "
                f"but did not finish within {timeout:.1f} s"
                if rank in reading
                else f"receiver rank {rank} did not pick up version {version} from {self.root} within {timeout:.1f} s"
            )
        for rank, ack in final.items():
            who = ack.get("reader") or {}
            if ack["state"] == "lost":
                problems["lost"][rank] = (
                    f"receiver rank {rank} (pid {who.get('pid')} on {who.get('host')}) died while reading version {version}"
                )
            elif ack["state"] == "refused":
                problems["refused"][rank] = (
                    f"receiver rank {rank} refused version {version}: {ack.get('message')}"
                )
            elif ack["state"] == "failed":
                problems["failed"][rank] = (
                    f"receiver rank {rank} failed version {version}: {ack.get('message')}"
                )
        ranks = sorted(r for group in problems.values() for r in group)
        if not ranks:
            return
        message = "; ".join(m for group in problems.values() for m in group.values())
        if problems["timeout"]:
            raise SyncTimeout(message, ranks=ranks)
        if problems["lost"]:
            raise PeerLost(message, ranks=ranks)
        if problems["refused"]:
            raise HandshakeError(message, ranks=ranks)
        raise RemoteFailure(message, ranks=ranks)

    # ------------------------------------------------------------------ receiver
    def offer(self, rank: int, version: int | None) -> Publication:
        """Wait (``timeout_s``) for a publication of ``version`` (None: of the newest
        version) other than the one this receiver read last."""
        root = self.root
        timeout = self.config.timeout_s
        end = time.monotonic() + timeout
        poll = POLL_MIN_S
        while True:
            published = published_versions(root)
            newest = published[-1] if published else None
            target = version if version is not None else newest
            if version is not None and version not in published:
                target = None
                if newest is not None and version < newest:
                    kept = ", ".join(map(str, published))
                    raise SyncError(
                        f"receiver rank {rank}: version {version} is not in {root}: it is older than the newest "
                        f"published version {newest}, so it was pruned (keep={self.keep}; kept: {kept}) or never published"
                    )
            read_before = False
            if target is not None:
                # None: renamed away between listing and reading (a retry replacing it)
                manifest = read_json(root / version_dir(target) / MANIFEST)
                if isinstance(manifest, dict):
                    read_before = self.last_read == (target, manifest.get("id"))
                    if not read_before:
                        return Publication(self, rank, target, manifest)
            if time.monotonic() >= end:
                have = "none" if newest is None else str(newest)
                held = self.last_read[0] if self.last_read is not None else None
                what = (
                    f"version {version} was not"
                    if version is not None
                    else f"no version newer than {held} was"
                    if held is not None
                    else "no version was"
                )
                again = (
                    f"; this receiver already read its publication {self.last_read[1]}"
                    if read_before and version is not None
                    else ""
                )
                raise SyncTimeout(
                    f"receiver rank {rank}: {what} published in {root} within {timeout:.1f} s "
                    f"(newest published: {have}{again})"
                )
            time.sleep(poll)
            poll = min(poll * 2, POLL_MAX_S)
