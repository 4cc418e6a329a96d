"""The sender's packer: pulls tensors from a source in plan order and fills buckets.

Data flows one way: ``Source -> Packer -> Transport``. With a plan, buckets come from it;
without one (a bare iterator), buckets are planned as tensors arrive and each is announced
to receivers (``announce``) before its bytes are sent.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from weightsync.errors import SourceFailed, SyncError
from weightsync.plan import Bucket, Plan, PlanBuilder, TensorSpec, as_bytes, pack_pieces, plan_hash
from weightsync.sources import WeightSource
from weightsync.verify import checksum_fn


class Packer:
    """Pulls tensors from a source in plan order and packs buckets from them.

    With a plan, buckets come from it; without one (a bare iterator), buckets are planned
    as tensors arrive and ``announce`` tells receivers each bucket before it is sent.
    Each tensor is held only until its last piece is packed. ``sends(bucket)`` (plan
    mode) says which buckets this rank sends; the others are passed over, their tensors
    still pulled in order (materializing a sharded tensor may be collective).
    """

    def __init__(
        self, source: WeightSource, bucket_bytes: int, plan: Plan | None, announce, sends=None
    ) -> None:
        self.items = iter(source.tensors())
        self.plan = plan
        self.announce = announce
        self.sends = sends
        self.builder = None if plan is not None else PlanBuilder(bucket_bytes)
        self.ready: list[Bucket] = []
        self.held: dict[int, torch.Tensor] = {}
        self.pulled = 0
        self.nbytes = 0  # the pulled tensors' bytes (the model's, without bucket padding)
        self.position = 0  # buckets of the plan walked past
        self.buckets = 0  # buckets produced
        self.announced_specs = 0
        self.done = False

    def _pull(self) -> bool:
        try:
            name, tensor = next(self.items)
        except StopIteration:
            return False
        except Exception as e:
            planned = self.plan.tensors if self.plan is not None else ()
            due = f" (tensor {planned[self.pulled].name!r} was due)" if self.pulled < len(planned) else ""
            raise SourceFailed(
                f"the source raised after {self.pulled} tensor(s): {type(e).__name__}: {e}{due}"
            ) from e
        spec = TensorSpec.of(name, tensor)
        if self.plan is not None:
            if self.pulled >= len(self.plan.tensors):
                raise SyncError(
                    f"the source yielded tensor {name!r} beyond the {len(self.plan.tensors)} it announced"
                )
            expected = self.plan.tensors[self.pulled]
            if spec != expected:
                raise SyncError(
                    f"the source yielded {spec} where its specs announced {expected}; "
                    "a source must yield exactly what specs() says, in order"
                )
        else:
            self.ready += self.builder.add(spec)
        self.held[self.pulled] = as_bytes(tensor)
        self.nbytes += spec.nbytes
        self.pulled += 1
        return True

    def _next_bucket(self) -> Bucket | None:
        if self.plan is not None:
            while self.position < len(self.plan.buckets):
                bucket = self.plan.buckets[self.position]
                self.position += 1
                if self.sends is None or self.sends(bucket):
                    return bucket
                self._pull_for(bucket)  # another rank sends it: walk past, keep order
                self._release(bucket)
            return None
        while not self.ready and not self.done:
            if not self._pull():
                self.ready += self.builder.finish()
                self.done = True
        return self.ready.pop(0) if self.ready else None

    def __call__(self, buffer: torch.Tensor) -> tuple[Bucket, torch.Tensor] | None:
        bucket = self._next_bucket()
        if bucket is None:
            if self.plan is not None and self.pulled < len(self.plan.tensors):
                raise SyncError(
                    f"the source ended after {self.pulled} of {len(self.plan.tensors)} announced tensors"
                )
            if self.plan is not None and next(self.items, None) is not None:
                raise SyncError(
                    f"the source yielded more than the {len(self.plan.tensors)} tensors it announced"
                )
            if self.builder is not None:
                self.announce(
                    {"type": "end", "plan_hash": plan_hash(self.builder.specs, self.builder.bucket_bytes)}
                )
            return None
        last = self._pull_for(bucket)
        payload = self._direct(bucket, buffer)
        if payload is None:
            pack_pieces(bucket, buffer, self.held)
            payload = buffer[: bucket.nbytes]
        self._release(bucket)
        if self.builder is not None:
            new = self.builder.specs[self.announced_specs : last + 1]
            self.announced_specs = max(self.announced_specs, last + 1)
            self.announce(
                {
                    "type": "bucket",
                    "bucket": bucket.to_wire(),
                    "tensors": [s.to_wire() for s in new],
                }
            )
        self.buckets += 1
        return bucket, payload

    @property
    def _specs(self) -> Sequence[TensorSpec]:
        return self.plan.tensors if self.plan is not None else self.builder.specs

    def _pull_for(self, bucket: Bucket) -> int:
        """Pull tensors until every one ``bucket`` needs is held; the last one's index."""
        last = max((p.tensor for p in bucket.pieces), default=-1)
        while self.pulled <= last:  # plan mode: pull what this bucket needs
            if not self._pull():
                raise SyncError(
                    f"the source ended after {self.pulled} of {len(self._specs)} announced tensors"
                )
        return last

    def _release(self, bucket: Bucket) -> None:
        specs = self._specs
        for p in bucket.pieces:
            if p.tensor_offset + p.length == specs[p.tensor].nbytes:
                self.held.pop(p.tensor, None)  # its last piece is out: let it go

    def _direct(self, bucket: Bucket, buffer: torch.Tensor) -> torch.Tensor | None:
        """The bucket's bytes as a view of its source tensor, if it is one range of one
        tensor already on the buffer's device: then nothing needs packing."""
        if len(bucket.pieces) != 1:
            return None
        p = bucket.pieces[0]
        src = self.held[p.tensor]
        if p.bucket_offset != 0 or not p.length or src.device != buffer.device:
            return None
        return src[p.tensor_offset : p.tensor_offset + p.length]


def producer(
    source: WeightSource,
    bucket_bytes: int,
    plan: Plan | None,
    verify: str,
    announce: Callable[[dict[str, Any]], None],
    sends: Callable[[Bucket], bool] | None = None,
) -> tuple[Packer, Callable[[torch.Tensor], tuple[Bucket, torch.Tensor] | None], dict[int, int]]:
    """A packer over ``source`` and a producer for the transport that also records each
    sent bucket's checksum (bucket index -> checksum, filled as buckets leave) when
    ``verify`` is on."""
    packer = Packer(source, bucket_bytes, plan, announce, sends=sends)
    checksum = checksum_fn(verify)
    sums: dict[int, int] = {}

    def produce(buffer: torch.Tensor) -> tuple[Bucket, torch.Tensor] | None:
        produced = packer(buffer)
        if produced is not None and checksum is not None:
            sums[produced[0].index] = checksum(produced[1])  # what leaves, before the transport
        return produced

    return packer, produce, sums
