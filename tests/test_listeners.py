"""No process of a loopback sync listens on a wildcard address: the control socket, the
data-plane rendezvous store, Gloo's sockets and everything else a backend opens follow
the interface the user chose. Every process (sender, receivers, other trainer ranks) runs
apart from the test, so only its own sockets are looked at, read from /proc."""

import pytest
import workers
from listeners import listeners_of, wildcards
from procs import CTX, collect, start, stop

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


# disk has no sockets at all; mooncake's own ports cannot be bound to an interface (see
# docs/reliability.md), so it is not among them.
@pytest.mark.parametrize("backend,trainers", [("nccl", 1), ("shm", 1), ("paired", 2)])
def test_no_process_of_a_loopback_sync_listens_on_a_wildcard_address(backend, trainers):
    overrides = [f"backend={backend}", "update_weights_bucket_megabytes=2", "timeout_s=120"]
    receivers, versions = 2, [1, 2, 3]
    said, heard, go = CTX.Queue(), CTX.Queue(), CTX.Queue()
    sender = start(workers.run_paced_sender, overrides, receivers, versions, said, go, trainers)
    procs = [sender]
    try:
        kind, address = said.get(timeout=120)
        assert kind == "listening"
        procs += [
            start(workers.run_receiver, address, r, overrides, versions, heard) for r in range(receivers)
        ]
        procs += [
            start(workers.run_paired_trainer, address, i, trainers, overrides, receivers, versions, heard)
            for i in range(1, trainers)
        ]
        for v in versions:
            go.put(v)
            assert said.get(timeout=240) == ("sent", v, None)
            for report in collect(heard, receivers + trainers - 1, timeout=120):
                assert report[1] == v, report
            if v == versions[-1]:  # the receivers leave after their last version
                continue
            # Between syncs every group, store and ring of this sync is still up.
            seen = {f"pid {p.pid}" + (" (sender)" if p is sender else ""): listeners_of(p.pid) for p in procs}
            assert not any(wildcards(found) for found in seen.values()), seen
            assert all(address == "127.0.0.1" for found in seen.values() for address, _ in found), seen
            ours = seen[f"pid {sender.pid} (sender)"]
            assert ("127.0.0.1", int(address.rpartition(":")[2])) in ours  # the control socket, seen
            if backend != "shm":  # plus the rendezvous store and Gloo's socket
                assert len(ours) >= 3, seen
        go.put("done")
    finally:
        stop(procs)
