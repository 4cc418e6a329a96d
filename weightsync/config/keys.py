"""The configuration's keys: every field with its documentation (English and Chinese), its
type, default and allowed values, and how a key is written (short, full verl or trainer form)
and a value read (``key=value`` strings, nested mappings).

Data and pure functions only, below everything that reads a configuration: ``config`` builds
and validates an ``EngineConfig`` from these keys, ``config_verl`` reads verl's own files
into them, and the docs' parameter tables are generated from them.
"""

from __future__ import annotations

import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, get_type_hints

PREFIX = "actor_rollout_ref.rollout.checkpoint_engine."
#: verl 0.9.1's ``trainer.v1.trainer_mode`` values (``sync`` is its default)
TRAINER_MODES = ("sync", "colocate_async", "separate_async")
#: weightsync's earlier name for verl's ``sync`` mode, still read as ``sync``
TRAINER_MODE_ALIASES = {"colocate": "sync"}
MOONCAKE_DEVICES = ("auto", "cuda", "npu", "cpu")
DELTA_MODES = ("off", "auto", "on")
VERIFY_MODES = ("off", "crc32", "xxh3")
UPDATE_MODES = ("stream", "staged")
#: environment variable read for the shared secret when ``auth_secret`` is unset
SECRET_ENV = "WEIGHTSYNC_SECRET"


class ConfigError(ValueError):
    """A configuration key or value is wrong; the message names the key and the value."""


def _doc(en: str, zh: str, **extra: Any) -> dict[str, Any]:
    return {"help": en, "help_zh": zh, **extra}


@dataclass
class NcclKwargs:
    """``engine_kwargs.nccl``: the collective broadcast backend."""

    group_name: str = field(
        default="default",
        metadata=_doc(
            "Name of the weight-sync process group (its rendezvous namespace). Read by `nccl` "
            "and `paired` (whose two-rank groups use the same collective library).",
            "权重同步进程组的名称（其集合通信会合命名空间）。由 `nccl` 和 `paired`（其两 rank 进程组使用同一集合通信库）读取。",
        ),
    )
    rebuild_group: bool = field(
        default=False,
        metadata=_doc(
            "Destroy the process group after every update and build it again at the next one "
            "(frees communicator memory between updates, costs a rendezvous per update). Read by "
            "`nccl` and `paired`.",
            "每次更新后销毁进程组，下次更新时重建（更新间释放通信器显存，代价是每次更新都要重新会合）。"
            "由 `nccl` 和 `paired` 读取。",
        ),
    )

    topology: str = field(
        default="auto",
        metadata=_doc(
            "Route of `nccl`'s buckets: `broadcast` (one collective from the sender to all: the "
            "sender's link carries the model once per receiver over Gloo), `chain` (two-rank "
            "groups sender -> receiver -> receiver ..., each forwarding in 1 MiB pieces as they "
            "arrive: every link carries the model once), or `auto`: `chain` when a receiver's "
            "control connection comes from another host than the sender's, else `broadcast`.",
            "`nccl` 的桶传输路径：`broadcast`（发送方对全体的一次集合通信；在 Gloo 上发送方链路为每个接收方"
            "各承载一次模型）、`chain`（两 rank 进程组 发送方 -> 接收方 -> 接收方 ...，每段按 1 MiB 分片边收边转发："
            "每条链路只承载一次模型）或 `auto`：有接收方的控制连接来自发送方以外的主机时用 `chain`，否则 `broadcast`。",
            choices=("auto", "broadcast", "chain"),
        ),
    )


@dataclass
class MooncakeKwargs:
    """``engine_kwargs.mooncake``: point-to-point through Mooncake Transfer Engine."""

    device: str = field(
        default="auto",
        metadata=_doc(
            "Device of the transfer buffers, which picks Mooncake's protocol: `cpu` -> TCP, "
            "`cuda` -> RDMA, `npu` -> ascend_direct; `auto` uses the process's device. On Ascend "
            "it must be `npu` (or `auto`).",
            "传输缓冲区所在设备，并据此选择 Mooncake 协议：`cpu` -> TCP，`cuda` -> RDMA，"
            "`npu` -> ascend_direct；`auto` 使用进程所在设备。昇腾上必须为 `npu`（或 `auto`）。",
            choices=MOONCAKE_DEVICES,
        ),
    )
    device_name: str = field(
        default="",
        metadata=_doc(
            "NIC / device name filter for Mooncake (empty: all), passed to Mooncake Transfer "
            "Engine as its device filter (comma-separated RDMA device names; unused over TCP).",
            "Mooncake 使用的网卡/设备名过滤（为空表示全部），作为设备过滤传给 Mooncake Transfer Engine"
            "（逗号分隔的 RDMA 设备名；TCP 下不使用）。",
        ),
    )


#: what carries each link of a ``sharded`` route (``ShardedKwargs.links``)
SHARDED_LINKS = ("collective", "mooncake")


@dataclass
class ShardedKwargs:
    """``engine_kwargs.sharded``: the M x N backend."""

    links: str = field(
        default="collective",
        metadata=_doc(
            "What carries each (trainer rank, receiver rank) link of `sharded`'s route: "
            "`collective` (a two-rank group of `nccl`'s library: NCCL on CUDA, HCCL on Ascend, "
            "Gloo on CPU) or `mooncake` (one-sided Mooncake Transfer Engine writes into buffers "
            "the receiving rank registered: TCP for host memory, RDMA for CUDA memory; needs the "
            "`mooncake` extra; `engine_kwargs.mooncake.device_name` picks the NICs). Trainer rank "
            "0's setting decides: the other ranks follow it.",
            "`sharded` 路由中每条（训练 rank，接收 rank）链路的承载方式：`collective`（使用 `nccl` 所用集合通信库的"
            "两 rank 进程组：CUDA 上为 NCCL，昇腾上为 HCCL，CPU 上为 Gloo）或 `mooncake`（Mooncake Transfer Engine "
            "单边写入接收 rank 注册的缓冲区：主机内存用 TCP，CUDA 显存用 RDMA；需要 `mooncake` 可选依赖；"
            "`engine_kwargs.mooncake.device_name` 选择网卡）。以训练 rank 0 的设置为准：其他 rank 随之采用。",
            choices=SHARDED_LINKS,
        ),
    )


#: fewest published versions the ``disk`` backend keeps (see ``DiskKwargs.keep``)
DISK_MIN_KEEP = 2


@dataclass
class DiskKwargs:
    """``engine_kwargs.disk``: checkpoints published in a shared directory."""

    path: str = field(
        default="",
        metadata=_doc(
            "Directory shared by the trainer and every receiver (a shared file system across "
            "hosts). Each version is published there as a Hugging Face style checkpoint "
            "(`v000000000007/`: safetensors shards, index, `weightsync.json` manifest); receivers "
            "acknowledge under `acks/`. Required by `backend=disk`.",
            "训练端与所有接收端共享的目录（跨机时为共享文件系统）。每个版本以 Hugging Face 风格的检查点"
            "发布于此（`v000000000007/`：safetensors 分片、索引、`weightsync.json` 清单）；接收端在 `acks/` "
            "下确认。`backend=disk` 时必填。",
        ),
    )
    keep: int = field(
        default=2,
        metadata=_doc(
            "Published versions kept in `path`; older ones are deleted after each publish. At "
            "least 2: with 1, publishing a version would delete the previous one while a reader "
            "the sender no longer waits for (a receiver that timed out or was removed, or an "
            "inference engine loading the directory itself) may still be reading it.",
            "`path` 中保留的已发布版本数；每次发布后删除更旧的版本。至少为 2：若为 1，发布新版本会删除上一版本，"
            "而发送端已不再等待的读取者（超时或被移除的接收端，或直接从该目录加载的推理引擎）可能仍在读取它。",
            allowed=f">= {DISK_MIN_KEEP}",
        ),
    )


@dataclass
class EngineKwargs:
    """``engine_kwargs``: per-backend options."""

    nccl: NcclKwargs = field(default_factory=NcclKwargs)
    mooncake: MooncakeKwargs = field(default_factory=MooncakeKwargs)
    sharded: ShardedKwargs = field(default_factory=ShardedKwargs)
    disk: DiskKwargs = field(default_factory=DiskKwargs)


@dataclass
class TrainerKeys:
    """Related keys from the trainer section, checked against the backend."""

    use_v1: bool = field(
        default=True,
        metadata=_doc(
            "`trainer.use_v1`: the v1 trainer (verl's default; needed for the `trainer.v1` modes).",
            "`trainer.use_v1`：使用 v1 训练器（verl 的默认值；`trainer.v1` 的各模式需要它）。",
        ),
    )
    trainer_mode: str = field(
        default="sync",
        metadata=_doc(
            "`trainer.v1.trainer_mode`, verl's modes: `sync` (verl's default: trainer and rollout "
            "take turns on the same devices), `colocate_async` (same devices, rollout runs ahead "
            "asynchronously) or `separate_async` (separate devices, weights pushed while rollout "
            "serves; needs a transport backend, not `naive`). In `sync` and `colocate_async` verl "
            "updates its colocated replicas with `naive` whatever `backend` says. `colocate`, "
            "weightsync's earlier name, is read as `sync`.",
            "`trainer.v1.trainer_mode`，即 verl 的模式：`sync`（verl 默认：训练与推理轮流共用设备）、"
            "`colocate_async`（共用设备，推理异步先行）或 `separate_async`（分离设备，推理服务期间推送权重；"
            "需要传输后端，不能用 `naive`）。在 `sync` 与 `colocate_async` 模式下，verl 对共置副本"
            "总是使用 `naive` 更新，与 `backend` 无关。weightsync 早先的名称 `colocate` 按 `sync` 读取。",
            choices=TRAINER_MODES,
            key="trainer.v1.trainer_mode",
        ),
    )


@dataclass
class EngineKeys:
    """The keys of verl's ``checkpoint_engine`` section, each with its documentation;
    ``weightsync.config.EngineConfig`` is this with reading, access and validation."""

    backend: str = field(
        default="naive",
        metadata=_doc(
            "Transfer backend: `naive` (colocated, same process), `nccl` (collective broadcast; "
            "HCCL on Ascend, Gloo on CPU), `shm` (one host: shared memory, CUDA IPC on GPUs), "
            "`ipc` (one host: receivers read the trainer's own tensors, shared by `share_tensors` or "
            "CUDA IPC; docs/ipc.md), "
            "`paired` (every trainer rank feeds its own replica, replicas forward along a ring), "
            "`sharded` (M x N: every trainer rank sends its own shards, each receiver rank takes only "
            "the slices it keeps; docs/sharded.md), "
            "`mooncake` (Mooncake Transfer Engine, point to point along a chain of receivers; "
            "needs the `mooncake` extra), `disk` (checkpoints in a shared directory, "
            "`engine_kwargs.disk.path`), or one registered by `custom_backend_module`.",
            "传输后端：`naive`（同进程共置）、`nccl`（集合通信广播；昇腾上为 HCCL，CPU 上为 Gloo）、"
            "`shm`（单机共享内存，GPU 上为 CUDA IPC）、`ipc`（单机：接收端直接读取训练端自身的张量，"
            "由 `share_tensors` 或 CUDA IPC 共享；见 docs/ipc.md）、`paired`（每个训练 rank 发给各自的副本，副本沿环转发）、"
            "`sharded`（M x N：每个训练 rank 只发送自己持有的分片，每个接收 rank 只接收自己保留的切片；见 docs/sharded.md）、"
            "`mooncake`（Mooncake Transfer Engine，沿接收端链点对点传输；需要 `mooncake` 可选依赖）、"
            "`disk`（共享目录中的检查点，见 `engine_kwargs.disk.path`），或由 `custom_backend_module` 注册的后端。",
            choices="registered backends",
        ),
    )
    update_weights_bucket_megabytes: int = field(
        default=2048,
        metadata=_doc(
            "Bucket size for one transfer, in MiB. Two buckets are in use at once (double "
            "buffering), so transfer memory is at most 2x this on each side (less when the "
            "whole model fits in a smaller bucket). Tensors larger than a bucket are split "
            "into chunks.",
            "单次传输的桶大小（MiB）。同时使用两个桶（双缓冲），因此每侧传输内存至多为其 2 倍"
            "（整个模型小于一个桶时更少）。大于桶的张量会被切块传输。",
        ),
    )
    timeout_s: float = field(
        default=300.0,
        metadata=_doc(
            "Deadline in seconds for every wait (connect, handshake, transfer, acknowledgement). "
            "A peer that does not answer in time fails the sync with an error naming it.",
            "每次等待（连接、握手、传输、确认）的超时秒数。对端超时未响应则同步失败，错误信息会指明该对端。",
        ),
    )
    heartbeat_grace_s: float | None = field(
        default=None,
        metadata=_doc(
            "How long a peer may be silent on the control plane before it is named and the sync "
            "fails: both sides probe each control connection (TCP keepalive, answered by the peer's "
            "kernel, so a busy process is never mistaken for a lost one) during syncs and between them. "
            "A host cut off, a dead link or a frozen machine is named within this grace instead of at "
            "timeout_s; a link that drops for less heals without an error. Unset: timeout_s / 3, "
            "at least 2 s and at most 10 s (never more than timeout_s).",
            "控制面上对端可沉默多久后被指名并使同步失败：双方在同步期间及两次同步之间探测每条控制连接"
            "（TCP keepalive，由对端内核应答，繁忙的进程不会被误判为失联）。被切断的主机、断开的链路或冻结的机器"
            "会在此宽限内被指名，而不是等到 timeout_s；短于此时长的链路中断会自行恢复而不报错。"
            "未设置时为 timeout_s / 3，至少 2 秒、至多 10 秒（不超过 timeout_s）。",
        ),
    )
    drop_lost_receivers: bool = field(
        default=False,
        metadata=_doc(
            "What the sender does with a receiver lost mid-sync (its process gone, or silent for "
            "heartbeat_grace_s). false: the sync fails, naming it in the error's ranks; the caller "
            "decides (Sender.remove_receiver). true: the lost receiver is dropped from the receivers; "
            "where the transport can build a data plane of the others at once (`nccl`, `mooncake`) "
            "they take the same version again in the same sync, which then succeeds "
            "(SyncStats.dropped names whom it left out); elsewhere (`paired`, `sharded`, `shm`) the sync fails "
            "and the next one goes to the others. Sender.add_receiver takes a dropped receiver back.",
            "发送方如何处理同步中途失联的接收方（进程退出，或沉默超过 heartbeat_grace_s）。false：同步失败，"
            "错误的 ranks 中指明该接收方，由调用方决定（Sender.remove_receiver）。true：将失联的接收方移出接收方集合；"
            "传输能立即为其余接收方建立新的数据面时（`nccl`、`mooncake`），它们在同一次同步中再次接收同一版本，同步随之成功"
            "（SyncStats.dropped 指明被排除者）；其他传输（`paired`、`sharded`、`shm`）上该次同步失败，下一次同步发往其余"
            "接收方。Sender.add_receiver 可重新加入被移出的接收方。",
        ),
    )
    receive_buckets_in_flight: int = field(
        default=2,
        metadata=_doc(
            "Receivers that load through an engine's own loader (the vLLM integration): the memory, "
            "in buckets, that received tensors may occupy at once in the worker (queued for the "
            "loader, being loaded, held by the engine until a layer completes, landed ahead), so a "
            "background thread's transfer runs ahead of the engine's loading by at most that much. "
            "One arena of this size (at most the model's bytes), allocated once and kept between "
            "versions; a tensor larger than all of it gets a buffer of its own beside it, and the bound is "
            "passed only while the engine holds more than it to complete a layer. At least 1.",
            "通过推理引擎自身加载器加载的接收端（vLLM 集成）：已接收张量在工作进程中同时占用的内存上限（以桶计："
            "排队等待加载、正在加载、引擎为凑齐一层而持有、提前落地的部分），后台线程的传输最多领先引擎加载这么多。"
            "该大小（至多为模型字节数）的一块内存只分配一次，跨版本复用；大于整块内存的张量在其之外使用单独的缓冲区；"
            "仅当引擎为凑齐一层需要持有更多时才会超出。至少为 1。",
            allowed=">= 1",
        ),
    )
    update_mode: str = field(
        default="stream",
        metadata=_doc(
            "How `VLLMRollout.update` updates vLLM replicas: `stream` (pause generation, stream the "
            "version into the running model, resume: no extra memory, generation stops for the whole "
            "transfer) or `staged` (stream it into a host copy of the model per worker while the "
            "replicas keep generating, then pause only for the local load: one more copy of the "
            "model in host memory per worker, pinned on GPUs; a transfer that fails never touches "
            "what the replicas serve). `update(..., staged=True/False)` overrides it per call.",
            "`VLLMRollout.update` 更新 vLLM 副本的方式：`stream`（暂停生成，把版本流式载入运行中的模型，再恢复："
            "不占额外内存，整个传输期间生成停止）或 `staged`（副本继续生成时，先把版本流式写入每个 worker 的一份"
            "主机内存模型副本，之后只为本地加载暂停：每个 worker 多占一份模型大小的主机内存，GPU 上为锁页内存；"
            "传输失败绝不会触及副本正在服务的权重）。`update(..., staged=True/False)` 可逐次覆盖。",
            choices=UPDATE_MODES,
        ),
    )
    verify: str = field(
        default="off",
        metadata=_doc(
            "End-to-end check of every bucket: `off`, `crc32` (standard library, about 2.5 GB/s "
            "per core) or `xxh3` (needs the `xxhash` package, several times faster). The sender "
            "checksums what it sent, each receiver what it got; a mismatch fails the sync on "
            "that receiver naming the tensors affected, and its version does not advance. "
            "Computed on the CPU (device buckets are copied to the host for it). Set the same "
            "value on both sides.",
            "逐桶端到端校验：`off`、`crc32`（标准库，单核约 2.5 GB/s）或 `xxh3`（需要 `xxhash` 包，"
            "快数倍）。发送端对发出的字节、接收端对收到的字节计算校验和；不一致时该接收端同步失败，"
            "报告受影响的张量，且版本不前进。在 CPU 上计算（设备上的桶会先拷到主机）。两端须设置相同的值。",
            choices=VERIFY_MODES,
        ),
    )
    delta: str = field(
        default="off",
        metadata=_doc(
            "Delta sync: `off` sends every version whole; `auto` sends each tensor as a delta "
            "against the last version sent (exact: changed elements by their bits) where that "
            "is fewer bytes, to every receiver that holds that base (checked by version and "
            "digest in the handshake); other receivers get the version whole in the same sync. "
            "The sender keeps a copy of the last version in host memory (wire dtype); a receiver "
            "that streams with `receive()` keeps one too (`load_into` applies deltas to the "
            "model in place). `auto` sends whole versions while deltas would not pay (predicted "
            "from a probe of each version, or measured); `on` never does (for links known to be "
            "slower than the codec, about 1 GB/s per core). Session backends with one sending "
            "trainer rank; `disk` always publishes whole checkpoints. Set the same value on both sides.",
            "增量同步：`off` 每个版本整体发送；`auto` 对每个张量在字节更少时发送相对于上一个已发送版本的"
            "增量（精确：按比特比较变化的元素），发给持有该基准的接收端（握手中按版本与摘要校验）；"
            "其他接收端在同一次同步中收到完整版本。发送端在主机内存中保留上一个版本的副本（传输 dtype）；"
            "用 `receive()` 流式接收的接收端也保留一份（`load_into` 直接在模型上原地应用增量）。"
            "增量不划算时（由对每个版本的抽样预测或实测得出）`auto` 整体发送；`on` 从不退回"
            "（用于已知比编解码更慢的链路，约每核 1 GB/s）。适用于只有一个发送训练 rank 的会话后端；"
            "`disk` 始终发布完整检查点。两端须设置相同的值。",
            choices=DELTA_MODES,
        ),
    )
    auth_secret: str | None = field(
        default=None,
        repr=False,
        metadata=_doc(
            "Shared secret that authenticates sender and receivers to each other in the "
            "handshake (HMAC-SHA256 over fresh nonces; the secret never travels). A peer "
            "without it is rejected and logged, and the sync goes on for the others. Unset: the "
            "environment variable `WEIGHTSYNC_SECRET`, if set (preferred: it stays out of config "
            "files). With `disk` the sender signs each version it publishes, and receivers refuse "
            "unsigned or wrongly signed ones. Authenticates peers only; it does not encrypt the weights.",
            "在握手中使发送端与接收端相互认证的共享密钥（基于新鲜随机数的 HMAC-SHA256，密钥本身不上线）。"
            "没有密钥的对端会被拒绝并记录日志，同步对其他对端照常进行。未设置时使用环境变量 "
            "`WEIGHTSYNC_SECRET`（推荐：不写进配置文件）。使用 `disk` 时，发送端对发布的每个版本签名，"
            "接收端拒绝未签名或签名错误的版本。只认证对端，不加密权重。",
        ),
    )
    custom_backend_module: str | None = field(
        default=None,
        metadata=_doc(
            "Module imported before the backend is looked up, so a plugin can register its own "
            "backend with `weightsync.engines.register_engine`.",
            "在查找后端之前导入的模块，插件可借此用 `weightsync.engines.register_engine` 注册自己的后端。",
        ),
    )
    engine_kwargs: EngineKwargs = field(default_factory=EngineKwargs)
    trainer: TrainerKeys = field(default_factory=TrainerKeys)


# --------------------------------------------------------------------- key table
@dataclass(frozen=True)
class Key:
    path: str  # attribute path inside EngineConfig, e.g. engine_kwargs.nccl.group_name
    display: str  # what users write in the short form
    full: str  # the full verl key
    type_name: str
    default: Any
    meta: Mapping[str, Any]


def all_keys() -> list[Key]:
    """Every configuration key, in declaration order."""
    keys: list[Key] = []

    def walk(cls: type, prefix: str) -> None:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            if dataclasses.is_dataclass(kind):
                walk(kind, f"{prefix}{f.name}.")
                continue
            path = f"{prefix}{f.name}"
            explicit = f.metadata.get("key")
            if path.startswith("trainer."):
                display = full = explicit or path
            else:
                display, full = path, PREFIX + path
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()  # type: ignore[misc]
            keys.append(Key(path, display, full, _type_name(kind), default, f.metadata))

    walk(EngineKeys, "")
    return keys


def _aliases() -> dict[str, str]:
    table = {}
    for k in all_keys():
        table[k.path] = table[k.display] = table[k.full] = k.path
    return table


def canonical_key(key: str) -> str:
    """Map a short, full or trainer key to its attribute path; suggest on a typo."""
    table = _aliases()
    if key in table:
        return table[key]
    short = key.removeprefix(PREFIX)
    if short in table:
        return table[short]
    raise ConfigError(
        f"unknown configuration key {key!r}{suggest(short, sorted({k.display for k in all_keys()}))}"
    )


def suggest(word: str, options: Iterable[str]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1, cutoff=0.5)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _type_name(kind: Any) -> str:
    if kind == (float | None):
        return "float or null"
    return {bool: "bool", int: "int", float: "float", str: "str"}.get(kind, "str or null")


def coerce(key: str, value: Any, kind: Any) -> Any:
    text = str(value).strip()
    try:
        if kind is bool:
            if isinstance(value, bool):
                return value
            low = text.lower()
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            if isinstance(value, bool):
                raise ValueError
            if isinstance(value, float) and not value.is_integer():
                raise ValueError
            return int(float(text)) if isinstance(value, float) else int(text)
        if kind is float:
            if isinstance(value, bool):
                raise ValueError
            return float(text)
        if kind == (str | None):
            return None if value is None or text.lower() in ("null", "none", "~", "") else text
        if kind == (float | None):
            if value is None or text.lower() in ("null", "none", "~", ""):
                return None
            if isinstance(value, bool):
                raise ValueError
            return float(text)
        return "" if value is None else text
    except ValueError:
        raise ConfigError(f"{key}={value!r}: expected {_type_name(kind)}") from None


def parse_overrides(overrides: Iterable[str]) -> list[tuple[str, str]]:
    items = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value")
        key, value = item.split("=", 1)
        items.append((key.strip(), value.strip()))
    return items


def flatten(data: Mapping[str, Any], prefix: str = "") -> Iterable[tuple[str, Any]]:
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, Mapping):
            yield from flatten(v, key + ".")
        else:
            yield key, v
