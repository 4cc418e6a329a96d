"""Process bodies of tests/test_pipeline.py (importable under spawn): a replica as the vLLM
integration runs one (``ReplicaReceiver``: pipelined receive, landing pool), loading into a
dict through a plain ``reload`` callable instead of vLLM."""

import time

import torch
import workers


def weights(version: int) -> dict[str, torch.Tensor]:
    """``workers.make_weights`` (a split tensor, packed small ones) plus 30 tensors of one
    1 MiB bucket each and 4 of 800 KB (a packed bucket each): 37 buckets of up to 1 MiB, many more
    than the transport's window and the in-flight bound."""
    g = torch.Generator().manual_seed(2000 + version)
    out = dict(workers.make_weights(version))
    for i in range(30):
        out[f"layers.{i}.direct"] = torch.randn(256, 1024, generator=g)
    for i in range(4):
        out[f"layers.{i}.packed"] = torch.randn(200, 1024, generator=g)
    return out


def expected(version: int) -> dict[str, str]:
    return {n: workers.digest(t.contiguous()) for n, t in weights(version).items()}


def replica(commands, results):
    """Serve ``(method, args, options)`` commands the way a vLLM worker extension serves
    ``collective_rpc`` (one result per call): ``weightsync_init``, ``weightsync_receive``
    (options shape the loader: ``sleep_first`` seconds on the first tensor, ``sleep_each``
    on every one, ``fail_after``
    tensors then raise, ``keep`` every tensor beyond the call), ``weightsync_status``,
    ``kept_digests``. Replies ``(status, digests loaded, extra)``."""
    from weightsync.integrations.replicas.receiver import ReplicaReceiver

    torch.set_num_threads(1)
    state = ReplicaReceiver()
    loaded: dict[str, str] = {}
    kept: list[tuple[str, torch.Tensor]] = []
    try:
        while (cmd := commands.get(timeout=180)) is not None:
            method, args, opts = cmd
            extra: dict = {}
            try:
                if method == "weightsync_init":
                    out = state.open(*args)
                elif method == "weightsync_receive":
                    ended = []

                    def reload(items, opts=opts, ended=ended):
                        for i, (name, tensor) in enumerate(items):
                            if i == 0 and opts.get("sleep_first"):
                                time.sleep(opts["sleep_first"])
                            time.sleep(opts.get("sleep_each", 0))
                            if opts.get("fail_after") is not None and i == opts["fail_after"]:
                                raise ValueError(f"the loader refused {name}")
                            loaded[name] = workers.digest(tensor)
                            if opts.get("keep"):
                                kept.append((name, tensor))
                        ended.append(True)  # the stream ended without an exception

                    out = state.receive(args[0], reload)
                    extra = {
                        "ended": bool(ended),
                        "allocations": state.pool.allocations,
                        "pool_bytes": state.pool.bytes,
                    }
                elif method == "weightsync_status":
                    out = state.status()
                elif method == "kept_digests":
                    out = {n: workers.digest(t) for n, t in kept}
                else:
                    raise ValueError(method)
                results.put((out, dict(loaded), extra))
            except BaseException as e:
                results.put(
                    ({"ok": False, "error": f"{type(e).__name__}: {e}"}, dict(loaded), {"raised": True})
                )
    finally:
        state.close()
