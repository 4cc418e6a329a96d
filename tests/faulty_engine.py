"""Test backends: `nccl` and `sharded` whose senders corrupt one byte (the middle one) of
bucket number $WEIGHTSYNC_TEST_CORRUPT (counted from 0, in the order they are sent) on the
wire while that variable is set (the source tensors are left intact). Registered as
`corrupting-nccl` and `corrupting-sharded` through `custom_backend_module=faulty_engine`."""

import os

from weightsync import register_engine
from weightsync.engines.nccl import CollectiveEngine
from weightsync.engines.sharded import ShardedEngine


class _Corrupting:
    def send_buckets(self, produce):
        if not os.environ.get("WEIGHTSYNC_TEST_CORRUPT"):
            return super().send_buckets(produce)
        target = int(os.environ["WEIGHTSYNC_TEST_CORRUPT"])
        count = 0

        def corrupt(buffer):
            nonlocal count
            produced = produce(buffer)
            count += 1
            if produced is None or count != target + 1:
                return produced
            bucket, payload = produced
            damaged = payload.clone()
            damaged[len(damaged) // 2] ^= 0xFF
            return bucket, damaged

        return super().send_buckets(corrupt)


class CorruptingEngine(_Corrupting, CollectiveEngine):
    name = "corrupting-nccl"


class CorruptingShardedEngine(_Corrupting, ShardedEngine):
    name = "corrupting-sharded"


register_engine("corrupting-nccl", CorruptingEngine)
register_engine("corrupting-sharded", CorruptingShardedEngine)
