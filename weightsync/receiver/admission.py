"""What a receiver admits: the checks of a sender's sync and warm-up messages, and of each
bucket a streamed sync announces.

Functions of the message, the receiver's configuration and its version state, run before
anything is read or allocated: each says what this receiver cannot take part in (a sentence
naming both sides' values), which ``Receiver`` sends back as its refusal.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from weightsync.config.engine import EngineConfig
from weightsync.errors import ProtocolError, SyncError
from weightsync.plan import Bucket, Plan, StreamedPlan, TensorSpec, plan_hash
from weightsync.session.channel import PROTOCOL_VERSION, Deadline
from weightsync.sinks import SinkError
from weightsync.state import VersionState

MAX_GROUP_SIZE = 1 << 16  # ranks in one data-plane group (a transport may allocate per rank)


def engine_problem(info: Any) -> str | None:
    """The session's part of a sync message's engine description: this receiver's group
    rank and the group's size (the rest belongs to the transport). What is wrong with it,
    or None."""
    if not isinstance(info, dict):
        return "the sync message carries no engine description"
    for key in ("rank", "world_size", "senders"):
        value = info.get(key, 1 if key == "senders" else None)
        if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_GROUP_SIZE:
            return f"engine {key}={value!r:.100}: expected an integer from 0 to {MAX_GROUP_SIZE}"
    if not 1 <= info["rank"] < info["world_size"]:
        return f"engine rank={info['rank']} is not a receiver's rank in a group of world_size={info['world_size']}"
    return None


def session_problem(msg: dict[str, Any], config: EngineConfig) -> str | None:
    """What a sync or warm-up message says that this receiver cannot take part in:
    another protocol, another bucket size, a bad engine description; or None."""
    if msg.get("protocol") != PROTOCOL_VERSION:
        return f"protocol version: sender {msg.get('protocol')!r}, receiver {PROTOCOL_VERSION}"
    if (bad := engine_problem(msg.get("engine"))) is not None:
        return bad
    if msg.get("bucket_bytes") != config.bucket_bytes:
        return (
            f"bucket size: sender {msg.get('bucket_bytes')} bytes, receiver {config.bucket_bytes} bytes "
            "(update_weights_bucket_megabytes must match)"
        )
    return None


def wire_plan(msg: dict[str, Any], config: EngineConfig, max_tensor_bytes: int | None) -> Plan:
    """The plan a sync or warm-up message carries, checked (sizes, its hash); raises
    ValueError saying what is wrong with it."""
    plan = Plan.from_wire(msg["plan"], bucket_bytes=config.bucket_bytes, max_tensor_bytes=max_tensor_bytes)
    if plan.hash != msg.get("plan_hash"):
        raise ValueError(f"plan hash: sender {msg.get('plan_hash')}, receiver computed {plan.hash}")
    return plan


def warmup_problem(
    msg: dict[str, Any], config: EngineConfig, max_tensor_bytes: int | None
) -> tuple[str | None, Plan | None]:
    """A warm-up that forms the data plane: what is wrong with it, and the plan of the first
    sync when it carries one."""
    problem = session_problem(msg, config)
    size = msg.get("capacity")
    if problem is None and (
        not isinstance(size, int) or isinstance(size, bool) or not 0 < size <= config.bucket_bytes
    ):
        problem = (
            f"capacity {size!r:.40}: expected a byte count from 1 to the bucket size ({config.bucket_bytes})"
        )
    plan = None
    if problem is None and "plan" in msg:  # what the first sync will send (its hash, then)
        try:
            plan = wire_plan(msg, config, max_tensor_bytes)
        except (ValueError, TypeError, KeyError) as e:
            problem = str(e)
    return problem, plan


def sync_problem(
    msg: dict[str, Any], expected: int | None, state: VersionState, config: EngineConfig
) -> str | None:
    """A sync this receiver must refuse before its plan is read: the session's terms, a
    version that is not the one expected or older than the one held, another verify mode."""
    v = msg.get("version")
    if (common := session_problem(msg, config)) is not None:
        return common
    if not isinstance(v, int) or isinstance(v, bool):
        return f"version {v!r} is not an integer"
    if expected is not None and v != expected:
        return f"version: sender sends {v}, receiver expects {expected}"
    if (stale := state.refusal(v, msg.get("force") is True)) is not None:
        return stale
    if msg.get("verify", "off") != config.verify:
        return f"verify: sender {msg.get('verify')!r}, receiver {config.verify!r} (set the same value on both sides)"
    return None


def agreed_plan(
    msg: dict[str, Any], held: Plan | None, config: EngineConfig, max_tensor_bytes: int | None
) -> tuple[Plan | None, str | None]:
    """The plan of a sync: the one it carries, or the one ``held`` when it sends only the
    same hash; None for a streamed sync (no hash). Returns it and what is wrong, if anything
    (ValueError from a plan that does not parse)."""
    if msg.get("plan_hash") is None:
        return None, None
    if "plan" in msg:
        return wire_plan(msg, config, max_tensor_bytes), None
    if held is not None and held.hash == msg["plan_hash"]:
        return held, None
    have = held.hash if held is not None else None
    return None, f"plan hash: sender {msg['plan_hash']}, receiver holds {have}"


def plan_reader(plan: Plan) -> Callable[[], Bucket | None]:
    """The buckets of an agreed plan, in order (``NextBucket`` for the transport)."""
    buckets = iter(plan.buckets)
    return lambda: next(buckets, None)


def stream_reader(
    ch: Any,
    specs: list[TensorSpec],
    deadline: Deadline,
    sink: Any,
    refused: list[BaseException],
    bucket_bytes: int,
    max_tensor_bytes: int | None,
) -> Callable[[], Bucket | None]:
    """Announced buckets, each checked (``StreamedPlan``) before the transport receives
    it; with a sink, each new spec is checked against the model before anything of it
    is allocated (a misfit goes to ``refused``: the sync stops and drains)."""
    stream = StreamedPlan(bucket_bytes, specs, max_tensor_bytes=max_tensor_bytes)

    def next_bucket() -> Bucket | None:
        msg = ch.recv(deadline, expect=("bucket", "end"))
        if msg["type"] == "end":
            mine = plan_hash(specs, bucket_bytes)
            if msg.get("plan_hash") != mine:
                raise SyncError(
                    f"streamed plan hash: sender {msg.get('plan_hash')}, receiver computed {mine}"
                )
            return None
        try:
            new, bucket = stream.announce(msg.get("tensors"), msg.get("bucket"))
        except ValueError as e:
            raise ProtocolError(
                f"{ch.peer} announced a bucket that is refused {deadline.what}: {e}"
            ) from None
        if sink is not None and not refused:
            try:
                sink.check(new)
            except SinkError as e:
                refused.append(e)
        return bucket

    return next_bucket
