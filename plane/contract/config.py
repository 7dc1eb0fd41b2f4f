"""Typed configuration objects, validated on construction. The CLI builds them from flags and
environment variables (read once, there); nothing else reads the environment."""

from __future__ import annotations

import socket
from dataclasses import dataclass, field

from plane.contract.errors import ConfigError
from plane.contract.subjects import InvalidToken, Names, check_token

DEFAULT_DEADLINE_MS = {"risk": 50, "calibrated": 1000}
# Compute backends a node runs (gpu_node.compute makes them; named here, in the contract, so
# that the CLI lists them without importing torch).
BACKENDS = ("auto", "torch", "interpret", "triton")
FALLBACK_DEADLINE_MS = 1000
GPU_GIL_SWITCH_US = 200  # NodeConfig.gil_switch_us on a partitioned device (a GPU)
MAX_DEADLINE_MS = 600_000
MAX_BODY_BYTES = 64 * 1024
MAX_SLOTS = 1024  # per node: the slot streams' shards list each slot number (provision)


@dataclass(frozen=True, kw_only=True)
class ConnectOptions:
    """How to reach NATS: URL plus the credentials of a secured server, passed to every
    command (`--nats`, `--user`, `--password`, `--token`, `--creds`, `--tls-ca`)."""

    url: str | None = None  # None: the embedded server started by `plane up`
    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds: str | None = None
    tls_ca: str | None = None
    name: str = "plane"
    # The server does not hand this connection what it publishes itself (a router's
    # connection: `plane.router.service.router_connection`).
    no_echo: bool = False

    def __post_init__(self) -> None:
        if (self.user is None) != (self.password is None):
            raise ConfigError("--user and --password go together: give both or neither")
        if self.token is not None and self.user is not None:
            raise ConfigError("give either --token or --user/--password, not both")


def serves_model(models: frozenset[str] | None, model: str) -> bool:
    """Whether a router of `models` (`RouterConfig.models`, a peer's presence; None: every
    model) serves `model`."""
    return models is None or model in models


def _token(kind: str, value: str) -> None:
    try:
        check_token(kind, value)
    except InvalidToken as exc:
        raise ConfigError(str(exc)) from exc


@dataclass(frozen=True, kw_only=True)
class RouterConfig:
    names: Names = field(default_factory=Names)
    router_id: str = field(default_factory=lambda: f"r-{socket.gethostname()[:20]}")
    max_body_bytes: int = MAX_BODY_BYTES
    default_deadline_ms: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_DEADLINE_MS))
    # A node whose heartbeat is older than this is dead: its in-flight requests get a 503.
    node_timeout_ms: int = 1000
    # How long after a request's deadline the router answers 504 for a node that said
    # nothing (nodes never answer after the deadline; this covers delivery and clock skew).
    deadline_grace_ms: int = 50
    publish_timeout_s: float = 2.0
    # Requests decided or placed at once; beyond it a request is refused 429 on arrival,
    # without a task, so a flood cannot starve the loop of heartbeats and done-events.
    max_routing: int = 1024
    # Requests read from the socket and not yet handled, per request subscription: past it
    # nats-py drops the message and the router answers it 429 at once (`overflowed`), so a
    # burst of any size costs bounded memory (with the default of nats-py, half a million,
    # a 20,000-request burst stepped RSS up 11-14% for good; with 512, 3%).
    max_pending: int = 512
    # While the router is behind (its oldest unread request has waited past 5 ms for 20 ms:
    # `plane.router.inbox`), it reads the newest first and refuses unread, 429 `busy`, a
    # request that waited longer than this in its inbox (not a ticket holder's, nor one
    # forwarded by another router): answered within the bound instead of decided when its
    # budget and promises are long gone.
    max_inbox_wait_ms: int = 50
    # The models this router serves (`plane router --models`): it listens for their requests,
    # done-events and the other routers' notes on them only, and makes their promises only
    # when it is the first by id of the routers that serve them. None: every model. Routers
    # split by model read none of each other's traffic: a plane whose router's CPU is its
    # limit gets another router's worth of decisions per model so split.
    models: frozenset[str] | None = None

    def __post_init__(self) -> None:
        _token("router id", self.router_id.replace(".", "-"))
        if self.models is not None:
            from plane.contract.models import MODELS  # (msgspec specs: not for a bare config)

            if not self.models:
                raise ConfigError("a router serves at least one model: give --models, or "
                                  "leave it out to serve every model")
            if unknown := sorted(self.models - MODELS.keys()):
                raise ConfigError(f"unknown model(s) {', '.join(unknown)}: the plane's models "
                                  f"are {', '.join(sorted(MODELS))}")
        if not 1 <= self.max_routing <= 1_000_000:
            raise ConfigError("max_routing must be between 1 and 1,000,000")
        if not 16 <= self.max_pending <= 1_000_000:
            raise ConfigError("max_pending must be between 16 and 1,000,000")
        if not 10 <= self.max_inbox_wait_ms <= MAX_DEADLINE_MS:
            raise ConfigError(f"max_inbox_wait_ms must be between 10 and {MAX_DEADLINE_MS}")
        if not 256 <= self.max_body_bytes <= 16 * 1024 * 1024:
            raise ConfigError("max_body_bytes must be between 256 B and 16 MiB")
        for model, ms in self.default_deadline_ms.items():
            _token("model", model)
            if not 1 <= ms <= MAX_DEADLINE_MS:
                raise ConfigError(f"deadline for {model} must be 1..{MAX_DEADLINE_MS} ms")

    def serves(self, model: str) -> bool:
        """Whether this router takes `model`'s requests (any model, without `models`)."""
        return serves_model(self.models, model)


DEVICE_WAITS = ("loop", "thread")  # `NodeConfig.device_waits`


@dataclass(frozen=True, kw_only=True)
class NodeConfig:
    names: Names = field(default_factory=Names)
    node_id: str = ""  # "": `n-<hostname>-<model>`, so nodes of two models on one host differ
    model: str = "risk"
    slots: int | None = None  # None: per backend (2 on CPU; SMs / sms_per_slot on CUDA)
    backend: str = "auto"  # auto | torch | interpret | triton
    sms_per_slot: int | None = None
    # On CUDA, slot k runs on SM partition first_partition + k: a group's members
    # (`plane node --processes`) take the device's partitions one after the other, not each
    # the first ones.
    first_partition: int = 0
    # How many nodes of this process share one device's partitions (`plane up`: one per
    # model). With no `slots`, a node on a backend that partitions the device (CUDA) takes
    # its default over this many, at least one: three models' 15 slots each on 15 SM groups
    # put three slots on every group, each partition running up to three requests at once.
    device_share: int = 1
    seed: int = 0
    advert_period_s: float = 1.0
    advert_ttl_s: float = 5.0
    heartbeat_period_s: float = 0.25
    probe_period_ms: int = 100
    probe_misses: int = 3
    # A slot's standing pull lives this long at the broker and is renewed at 80% of it: the
    # longest a pull lost without a word (a broker that kept no state, no reconnect seen) goes
    # unreplaced.
    pull_expiry_s: float = 5.0
    # A slot whose calls have all taken at most this long (its last `INLINE_AFTER`) runs the
    # next on the event loop, without the hop to its thread and back (~30 us each way on a
    # small host): for short work the hop costs more than the work. The loop is held for the
    # call (the node's other slots wait), so past about the hop's own cost the thread serves
    # more per second: keep it near that. 0: always the thread. None: per backend, 50 on a
    # CPU and 0 on a GPU, where a kernel that hangs must stay one slot's fault (on its
    # thread, the health supervisor withdraws that slot; on the loop it would stop the node).
    inline_work_us: int | None = None
    # The GIL's switch interval (`sys.setswitchinterval`) of the process the node runs in,
    # set as it starts; 0 leaves Python's 5 ms; None: per backend, GPU_GIL_SWITCH_US on a
    # partitioned device (a GPU), 0 on a CPU. A slot's thread takes the GIL twice a request
    # (to launch, and to hand the answer back); while the event loop is busy it waits until
    # the loop gives the GIL up, which Python asks of a busy thread only once an interval.
    # On an H200 host (16 cores, 15 slots of calibrated 2 ms; scripts/gpu_shapes.py, two
    # runs), 200 us against 5 ms: at 3,000/s offered 2,927 against 2,433 and 1,339 against
    # 1,316 answers/s, at 6,000/s 2,330 against 2,199 and 994 against 287; the slot's time
    # past the work at 1,000/s, p99, 3.8 and 3.6 ms against 5.0 and 4.6. On the 2-core CPU
    # host, where the slot threads, the loop, the broker and the load share two cores, it
    # helped 2 slots of 5 ms at 2x and cost 3 slots of 1.5 ms (CPU-bound) a tenth of their
    # answers (BENCHMARKS.md, "GPU" and "Twenty-fourth session").
    gil_switch_us: int | None = None
    # How a slot waits for its device work (`gpu_node.device_wait`): "loop", launched on the
    # event loop and its end awaited there (a timerfd to its predicted end, then a poll of
    # its CUDA event), or "thread", launched and waited for on the slot's own thread. On a
    # GPU, "loop" holds only for slots whose warm-up check of it passed; compute on a CPU
    # (the torch backend's risk, a generation) and a slot with a fault injected stay on the
    # thread either way. On the 2-core CPU host, 4 slots of calibrated 2 ms at 0.9x of the
    # closed-loop capacity: newcomers refused at their first try 2-27% against 84-95% (the
    # slot threads' wakes waited for a core), at 2x 1,014-1,042 answers a second against
    # 858-866; 4 slots of 20 ms at 2x answered 1.2-1.5% fewer, not yet explained
    # (BENCHMARKS.md, "Thirty-second session").
    device_waits: str = "loop"
    # Shutdown: how long in-flight work may take to finish before it is answered 503.
    drain_timeout_s: float = 5.0
    # Accept fault-injection commands on `<prefix>.fault.<node>` (tests and drills only).
    allow_faults: bool = False
    # GPU telemetry (gpu_node/telemetry.py): NVML read every this many seconds on CUDA.
    gpu_sample_period_s: float = 1.0
    default_deadline_ms: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_DEADLINE_MS))

    def __post_init__(self) -> None:
        _token("model", self.model)
        if not self.node_id:
            object.__setattr__(self, "node_id", f"n-{socket.gethostname()[:20]}-{self.model}")
        _token("node", self.node_id)
        if self.inline_work_us is not None and not 0 <= self.inline_work_us <= 10_000:
            raise ConfigError("inline_work_us must be between 0 and 10,000 (us)")
        if self.device_share < 1:
            raise ConfigError("device_share must be at least 1")
        if self.gil_switch_us is not None and not 0 <= self.gil_switch_us <= 100_000:
            raise ConfigError("gil_switch_us must be between 0 and 100,000 (us)")
        if self.device_waits not in DEVICE_WAITS:
            raise ConfigError(f"device_waits must be one of {', '.join(DEVICE_WAITS)}, "
                              f"got {self.device_waits!r}")
        if self.slots is not None and not 1 <= self.slots <= MAX_SLOTS:
            raise ConfigError(f"--slots must be between 1 and {MAX_SLOTS}")
        if self.backend not in BACKENDS:
            raise ConfigError("--backend must be one of auto, torch, interpret, triton")
        if self.sms_per_slot is not None and self.sms_per_slot < 1:
            raise ConfigError("--sms-per-slot must be at least 1")
        if self.probe_period_ms < 10:
            raise ConfigError("probe period must be at least 10 ms")
        if not 0.05 <= self.gpu_sample_period_s <= 3600:
            raise ConfigError("--gpu-sample-ms must be between 50 and 3,600,000")
