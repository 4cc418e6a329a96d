"""A test backend: `nccl` whose sender corrupts one byte of its second bucket on the wire
while $WEIGHTSYNC_TEST_CORRUPT is set (the source tensors are left intact). Registered as
`corrupting-nccl` through `custom_backend_module=faulty_engine`."""

import os

from weightsync import register_engine
from weightsync.engines.nccl import CollectiveEngine


class CorruptingEngine(CollectiveEngine):
    name = "corrupting-nccl"

    def send_buckets(self, produce):
        if not os.environ.get("WEIGHTSYNC_TEST_CORRUPT"):
            return super().send_buckets(produce)
        count = 0

        def corrupt(buffer):
            nonlocal count
            produced = produce(buffer)
            count += 1
            if produced is None or count != 2:
                return produced
            bucket, payload = produced
            damaged = payload.clone()
            damaged[len(damaged) // 2] ^= 0xFF
            return bucket, damaged

        return super().send_buckets(corrupt)


register_engine("corrupting-nccl", CorruptingEngine)
