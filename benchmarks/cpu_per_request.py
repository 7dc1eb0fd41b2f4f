"""CPU per request, process by process: the plane's router, its node and its nats-server,
against a bare nats-py echo responder (the floor) and its own nats-server, in one run.

    .venv/bin/python benchmarks/cpu_per_request.py [--duration 20 | --requests N]
                                                   [--slots 4] [--work-us 0] [--json]
                                                   [--node-processes 1] [--routers 1]
                                                   [--relay]

What runs: two nats-servers on loopback (one per path, so each one's CPU is its path's), the
floor's echo responder (`floor_responder.py`), and the plane as two processes, `plane router`
and `plane node --model calibrated --backend torch`, so that their CPU is read apart. CPU is
utime + stime of each process from /proc/<pid>/stat (all its threads, in clock ticks: 10 ms
each), read just before and just after each measured load. The caller is this process (its
own uvloop event loop), counted for neither path. Every request is one plain core-NATS
request, the same code for both paths, with no SDK and no retries: one plane request is one
router decision. With `--routers N` the plane has N `plane router` processes in one queue
group, and the router's figure is all of theirs per decision: a request that lands on a
router that does not make the model's promises and finds no slot free is forwarded to the
one that does (two more messages, and a decision in each), which the figure counts.

With `--relay`, a third path runs between them: `depth_one_relay.py`, the plane's message
flow with none of its code (its relay in the router's column, its worker in the node's, and
their own nats-server): the least a depth-one plane built on these messages can cost, so
that the plane's distance to the floor splits into the flow's share and its own code's.

The loads, each on the floor and then on the plane, after a quiet --settle (promises the
plane made to refused callers, who never come back for them, lapse meanwhile):
- closed loop, 1 caller;
- closed loop, one caller per slot: the share refused 429 there is the false refusal (a slot
  the router still counts busy although its caller has had its answer);
- open loop (pulse's driver, latency from each request's scheduled send time) at 0.9x the
  plane's capacity measured in the load before (its 200s per second), the same rate offered
  to the floor;
- refusals: every slot of the plane held by back-to-back long calls (`HOLD_US`, sent apart
  and not counted), and one closed-loop caller per slot, every one of whose requests is
  refused 429: a refusal is a decision too, and under overload most decisions are refusals.
  The floor runs the same closed loop. Its latencies are those of the 429s (a refusal's
  round trip against the echo's); the node places nothing, so it has no figure there.

The ratios, against their targets: router CPU per decision / echo CPU per request (<= 2),
node CPU per placed request (a 200) / echo (<= 3), nats-server CPU per plane request / per
floor request (<= 3), plane p50 / floor p50 (<= 2.0) and p99 / floor p99 (<= 2.5), over 200
answers. Idle CPU (with no load: heartbeats, probes, watches) is measured first and printed
apart; the per-request figures include it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.children import child, until  # noqa: E402
from benchmarks.core_caller import CoreRequest, Size, closed_loop  # noqa: E402
from plane.contract.embedded import EmbeddedNats  # noqa: E402
from plane.contract.lifecycle import run  # noqa: E402
from plane.contract.quantiles import quantile  # noqa: E402
from plane.contract.subjects import Header, Names  # noqa: E402
from plane.pulse.outcome import ERROR, TIMEOUT  # noqa: E402
from plane.pulse.runner import LoadConfig, run_load  # noqa: E402

BIN = Path(sys.executable).parent
CLK_TCK = os.sysconf("SC_CLK_TCK")
FLOOR_SUBJECT = "bench.echo"
RELAY_SUBJECT = "bench.relay"
MODEL = "calibrated"
# The refusals load: each slot held by calls this long (`calibrated`'s longest), one after
# another, with a deadline to match. A holder waits for its answer as long as the deadline:
# one that gave up before its call ended sent the next into a plane whose slots were all
# busy, was refused at once and sent again, in a loop beside the measured callers (the
# router's CPU for those refusals counted against theirs) that, on Python 3.11, a cancel
# could not stop (`asyncio.wait_for` drops a cancel that meets a reply just in): the load
# never ended.
HOLD_US = 10_000_000
HOLD_DEADLINE_MS = 30_000


# -- CPU of a process, from /proc ------------------------------------------------------------
def cpu_ticks(pid: int) -> int:
    """utime + stime of process `pid` (all its threads, ended ones too), in clock ticks."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    after_name = stat[stat.rindex(")") + 2:].split()  # the command name may hold spaces
    return int(after_name[11]) + int(after_name[12])  # proc(5) fields 14 (utime), 15 (stime)


def tree_ticks(pid: int) -> int:
    """`cpu_ticks` of `pid` and of its live descendants (a node group's member processes)."""
    children = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            children += [int(c) for c in (task / "children").read_text().split()]
    return cpu_ticks(pid) + sum(tree_ticks(c) for c in children)


def read_cpu(pids: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    return {role: sum(tree_ticks(pid) for pid in ps) for role, ps in pids.items()}


def tree_wakes(pid: int) -> int:
    """Voluntary context switches of every live thread of `pid` and of its descendants: how
    often they went to sleep and were woken. On this project's VMs a wake from idle costs
    more CPU than the work it wakes for (`benchmarks/wake_cost.py`), so at one caller the CPU
    per request follows this count more than it follows Python."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            for line in (task / "status").read_text().splitlines():
                if line.startswith("voluntary_ctxt_switches:"):
                    total += int(line.split()[1])
            total += sum(tree_wakes(int(c)) for c in (task / "children").read_text().split())
    return total


def read_wakes(pids: Mapping[str, tuple[int, ...]]) -> dict[str, int]:
    return {role: sum(tree_wakes(pid) for pid in ps) for role, ps in pids.items()}


# -- the two paths -------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class System:
    """One path under test: where its requests go, and the processes whose CPU they cost."""

    name: str
    url: str
    subject: str
    headers: dict[str, str] | None
    pids: dict[str, tuple[int, ...]]  # role -> its processes' PIDs (the routers: one or more)

    def target(self) -> CoreRequest:
        return CoreRequest(self.url, self.subject, self.headers)


def _pid(proc: EmbeddedNats | asyncio.subprocess.Process) -> int:
    assert proc.pid is not None
    return proc.pid


def _answered(final: str) -> bool:
    return final not in (TIMEOUT, ERROR)


def _ok(final: str) -> bool:
    return final == "200"


async def _answers(system: System, wanted: Callable[[str], bool], body: bytes) -> bool:
    """Whether one request to `system` now comes back as `wanted`."""
    async with system.target() as target:
        return wanted((await target.send(body)).final)


@contextlib.asynccontextmanager
async def floor_system(logs: Path, body: bytes) -> AsyncIterator[System]:
    async with EmbeddedNats() as srv:
        log = logs / "floor.log"
        async with child([sys.executable, str(REPO / "benchmarks" / "floor_responder.py"),
                          srv.url, FLOOR_SUBJECT], log) as echo:
            floor = System(name="floor", url=srv.url, subject=FLOOR_SUBJECT, headers=None,
                           pids={"echo": (_pid(echo),), "nats-server": (_pid(srv),)})
            await until("echo responder", lambda: _answers(floor, _ok, body), 30, log)
            yield floor


@contextlib.asynccontextmanager
async def relay_system(logs: Path, body: bytes, *, slots: int) -> AsyncIterator[System]:
    """`depth_one_relay.py` with `slots` slots, its worker and its relay as two processes."""
    relay = [sys.executable, str(REPO / "benchmarks" / "depth_one_relay.py")]
    async with EmbeddedNats() as srv, contextlib.AsyncExitStack() as stack:
        wlog, rlog = logs / "relay-worker.log", logs / "relay.log"
        # The worker first: it makes the stream the relay publishes to.
        worker = await stack.enter_async_context(
            child([*relay, srv.url, RELAY_SUBJECT, "--slots", str(slots), "--role", "worker"],
                  wlog))
        await until("relay worker", lambda: asyncio.to_thread(_logged, wlog, "ready"), 30, wlog)
        router = await stack.enter_async_context(
            child([*relay, srv.url, RELAY_SUBJECT, "--slots", str(slots), "--role", "relay"],
                  rlog))
        system = System(name="relay", url=srv.url, subject=RELAY_SUBJECT, headers=None,
                        pids={"router": (_pid(router),), "node": (_pid(worker),),
                              "nats-server": (_pid(srv),)})
        await until("depth-one relay", lambda: _answers(system, _ok, body), 30, rlog)
        yield system


def _logged(log: Path, line: str) -> bool:
    return log.exists() and line in log.read_text()


@contextlib.asynccontextmanager
async def plane_system(logs: Path, body: bytes, *, slots: int, deadline_ms: int,
                       node_processes: int = 1, routers: int = 1,
                       router_cmd: Sequence[str] = (str(BIN / "plane"), "router"),
                       ) -> AsyncIterator[System]:
    """An embedded nats-server, `routers` routers (`router_cmd` and its arguments: `plane
    router`, or benchmarks/router_split.py's probed one; one queue group, ids `bench`,
    `bench2`, ...) and a node of `slots` slots, answering."""
    async with EmbeddedNats() as srv, contextlib.AsyncExitStack() as stack:
        common = ["--nats", srv.url, "--log-level", "warning"]
        rlog, nlog = logs / "router.log", logs / "node.log"
        router_pids = []
        for i in range(routers):
            rid = "bench" if i == 0 else f"bench{i + 1}"
            log = rlog if i == 0 else logs / f"router{i + 1}.log"
            proc = await stack.enter_async_context(
                child([*router_cmd, *common, "--router-id", rid], log))
            router_pids.append(_pid(proc))
        node = await stack.enter_async_context(
            child([str(BIN / "plane"), "node", *common, "--model", MODEL, "--slots", str(slots),
                   "--backend", "torch", "--node-id", "bench",
                   "--processes", str(node_processes)], nlog))
        plane = System(name="plane", url=srv.url, subject=Names().infer(MODEL),
                       headers={Header.DEADLINE_MS: str(deadline_ms)},
                       pids={"router": tuple(router_pids), "node": (_pid(node),),
                             "nats-server": (_pid(srv),)})
        await until("plane router", lambda: _answers(plane, _answered, body), 30, rlog)
        await until("plane node", lambda: _answers(plane, _ok, body), 90, nlog)
        yield plane


# -- measuring -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Load:
    name: str
    callers: int | None = None  # closed loop
    rate: float | None = None  # open loop, requests per second
    held: bool = False  # every slot of the plane held by long calls meanwhile: all refused


@dataclass(frozen=True, kw_only=True)
class Measured:
    system: str
    load: str
    seconds: float
    requests: int
    statuses: dict[str, int]
    reasons: dict[str, int]  # "429 busy": count, for each status and Plane-Reason not a 200
    p50_ms: float
    p99_ms: float
    cpu_ticks: dict[str, int]  # role -> ticks spent over the load
    cpu_us: dict[str, float]  # role -> µs per request it served (see `per_request_us`)
    wakes: dict[str, float]  # role -> voluntary context switches per request it served

    @property
    def ok_per_s(self) -> float:
        return self.statuses.get("200", 0) / self.seconds

    @property
    def refused_share(self) -> float:
        return self.statuses.get("429", 0) / max(1, self.requests)


def per_request(counts: Mapping[str, int], statuses: Mapping[str, int],
                requests: int) -> dict[str, float]:
    """`counts` of each process per request it served: the router per decision (every request
    answered), the node per placed request (a 200), the others per request sent. A process
    that served none (the node while every request is refused) has no figure."""
    served = {"router": requests - statuses.get(TIMEOUT, 0) - statuses.get(ERROR, 0),
              "node": statuses.get("200", 0)}
    return {role: n / served.get(role, requests) for role, n in counts.items()
            if served.get(role, requests)}


def per_request_us(ticks: Mapping[str, int], statuses: Mapping[str, int],
                   requests: int) -> dict[str, float]:
    """CPU µs of each process per request it served (see `per_request`)."""
    return {role: n * 1e6 / CLK_TCK for role, n in per_request(ticks, statuses, requests).items()}


@contextlib.asynccontextmanager
async def slots_held(system: System, slots: int) -> AsyncIterator[None]:
    """Every slot of the plane busy with back-to-back `HOLD_US` calls until the block ends
    (one holder per slot, on its own connection); yields once a request is refused."""
    holder = CoreRequest(system.url, system.subject, {Header.DEADLINE_MS: str(HOLD_DEADLINE_MS)},
                         timeout_s=HOLD_DEADLINE_MS / 1000 + 5)
    body = json.dumps({"duration_us": HOLD_US}).encode()
    done = asyncio.Event()  # checked as well as the cancel: see HOLD_US

    async def hold() -> None:
        while not done.is_set():
            await holder.send(body)

    async with holder, asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(hold()) for _ in range(slots)]
        try:
            probe = json.dumps({"duration_us": 0}).encode()
            await until("every slot held", lambda: _answers(system, lambda f: f == "429", probe),
                        30, Path(os.devnull))
            yield
        finally:
            done.set()
            for t in tasks:
                t.cancel()


async def measure(system: System, body: bytes, load: Load, size: Size,
                  slots: int = 0) -> Measured:
    async with contextlib.AsyncExitStack() as stack:
        refusals = load.held and system.name != "floor"
        if refusals:
            await stack.enter_async_context(slots_held(system, slots))
        target = await stack.enter_async_context(system.target())
        before = read_cpu(system.pids)
        woken = read_wakes(system.pids)
        t0 = time.monotonic()
        if load.rate is None:
            outcomes = await closed_loop(target, body, load.callers or 1, size)
        else:
            # (half an arrival more, so that float rounding never drops the last one)
            seconds = (size.requests + 0.5) / load.rate if size.requests else size.seconds
            outcomes = (await run_load(target, body, LoadConfig(
                rate=load.rate, duration_s=seconds, concurrency=4096))).outcomes
        elapsed = time.monotonic() - t0
        after = read_cpu(system.pids)
        wakes = {role: n - woken[role] for role, n in read_wakes(system.pids).items()}
    statuses = dict(Counter(o.attempts.final for o in outcomes))
    timed = "429" if refusals else "200"  # the latencies of the answers the load is about
    ok_us = [o.latency_us for o in outcomes if o.attempts.final == timed]
    ticks = {role: after[role] - before[role] for role in before}
    if refusals:  # the node ran only the holders' calls: no figure of its own here
        del ticks["node"], wakes["node"]
    return Measured(system=system.name, load=load.name, seconds=elapsed,
                    requests=len(outcomes), statuses=statuses, reasons=dict(target.reasons),
                    p50_ms=quantile(ok_us, 0.50) / 1000, p99_ms=quantile(ok_us, 0.99) / 1000,
                    cpu_ticks=ticks, cpu_us=per_request_us(ticks, statuses, len(outcomes)),
                    wakes=per_request(wakes, statuses, len(outcomes)))


async def idle_cpu(systems: Sequence[System], seconds: float) -> dict[str, dict[str, float]]:
    """CPU ms per second of each process with no load at all."""
    before = {s.name: read_cpu(s.pids) for s in systems}
    await asyncio.sleep(seconds)
    return {s.name: {role: (t - before[s.name][role]) * 1000 / CLK_TCK / seconds
                     for role, t in read_cpu(s.pids).items()} for s in systems}


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    slots: int = 4
    work_us: int = 0
    deadline_ms: int = 1000
    requests: int | None = None  # per load and path; None: for duration_s each
    duration_s: float = 20.0
    open_factor: float = 0.9
    warmup: int = 500
    idle_s: float = 5.0
    # Quiet before each load, so that what one left behind (promises made to refused callers,
    # which plain callers never redeem) has lapsed before the next begins.
    settle_s: float = 2.0
    node_processes: int = 1  # `plane node --processes`: the node's CPU is all its processes'
    routers: int = 1  # `plane router` processes (one queue group): their CPU together
    relay: bool = False  # also the depth-one relay (the plane's messages, none of its code)

    @property
    def size(self) -> Size:
        return Size(self.requests, self.duration_s)


@dataclass(frozen=True, kw_only=True)
class Ratio:
    name: str
    target: float
    # (floor, plane) -> (the plane's figure, the floor's); see `of`
    figures: Callable[[Measured, Measured], tuple[float | None, float | None]]

    def of(self, floor: Measured, plane: Measured) -> float | None:
        """The ratio; None when either figure is missing (a node that placed nothing) or the
        floor's is 0 (a short run in which the floor's process spent less than one tick)."""
        mine, theirs = self.figures(floor, plane)
        return mine / theirs if mine is not None and theirs else None


RATIOS = (
    Ratio(name="router CPU per decision / echo CPU per request", target=2.0,
          figures=lambda f, p: (p.cpu_us.get("router"), f.cpu_us.get("echo"))),
    Ratio(name="node CPU per placed request / echo CPU per request", target=3.0,
          figures=lambda f, p: (p.cpu_us.get("node"), f.cpu_us.get("echo"))),
    Ratio(name="nats-server CPU per request: plane / floor", target=3.0,
          figures=lambda f, p: (p.cpu_us.get("nats-server"), f.cpu_us.get("nats-server"))),
    Ratio(name="p50: plane / floor", target=2.0, figures=lambda f, p: (p.p50_ms, f.p50_ms)),
    Ratio(name="p99: plane / floor", target=2.5, figures=lambda f, p: (p.p99_ms, f.p99_ms)),
)


@dataclass(frozen=True, kw_only=True)
class Result:
    idle_ms_per_s: dict[str, dict[str, float]]
    capacity_per_s: float  # the plane's, closed loop, one caller per slot
    rows: list[Measured]

    @property
    def false_refusals(self) -> Measured:
        """The plane, closed loop, one caller per slot: every 429 there is a false refusal."""
        return [m for m in self.rows if m.system == "plane"][1]

    def pairs(self, system: str = "plane") -> list[tuple[Measured, Measured]]:
        """(floor, `system`) for each load, in the order they ran."""
        return [(f, p) for f in self.rows if f.system == "floor"
                for p in self.rows if p.system == system and p.load == f.load]

    @property
    def systems(self) -> list[str]:
        """The paths measured against the floor: the plane, and the relay if it ran."""
        return [s for s in ("plane", "relay") if any(m.system == s for m in self.rows)]


async def bench(cfg: BenchConfig, logs: Path) -> Result:
    body = json.dumps({"duration_us": cfg.work_us}).encode()
    async with (floor_system(logs, body) as floor,
                contextlib.AsyncExitStack() as maybe,
                plane_system(logs, body, slots=cfg.slots, deadline_ms=cfg.deadline_ms,
                             node_processes=cfg.node_processes, routers=cfg.routers) as plane):
        relay = (await maybe.enter_async_context(relay_system(logs, body, slots=cfg.slots)),
                 ) if cfg.relay else ()
        systems = (floor, *relay, plane)  # the plane last: its capacity sets the open load
        for s in systems:
            await measure(s, body, Load("warm-up", callers=1), Size(cfg.warmup, 0.0))
        idle = await idle_cpu(systems, cfg.idle_s)
        rows: list[Measured] = []

        async def on_both(load: Load) -> None:
            for s in systems:
                await asyncio.sleep(cfg.settle_s)
                rows.append(m := await measure(s, body, load, cfg.size, cfg.slots))
                click.echo(f"{s.name}, {load.name}: {m.requests} requests, {m.statuses} "
                           f"{m.reasons or ''}", err=True)

        await on_both(Load("closed, 1 caller", callers=1))
        await on_both(Load(f"closed, {cfg.slots} callers", callers=cfg.slots))
        capacity = rows[-1].ok_per_s  # the plane's, one caller per slot
        rate = round(cfg.open_factor * capacity, 1)
        await on_both(Load(f"open, {cfg.open_factor:g}x capacity ({rate:g}/s)", rate=rate))
        # Last: the held calls run on after it (the plane stops them as it stops).
        await on_both(Load(f"refusals, {cfg.slots} callers", callers=cfg.slots, held=True))
        return Result(idle_ms_per_s=idle, capacity_per_s=capacity, rows=rows)


# -- report --------------------------------------------------------------------------------
def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def print_tables(cfg: BenchConfig, result: Result, console: Console) -> None:
    size = (f"{cfg.size.requests} requests" if cfg.size.requests
            else f"{cfg.size.seconds:g} s") + " per load and path"
    console.print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
                  f"{platform.python_version()}; {cfg.routers} router(s), {cfg.slots} slots "
                  f"over {cfg.node_processes} node process(es), `{MODEL}` "
                  f"{cfg.work_us} µs, deadline {cfg.deadline_ms} ms, {size}; "
                  f"CPU from /proc in ticks of {1000 / CLK_TCK:g} ms")
    idle = "; ".join(f"{name}: " + ", ".join(f"{role} {v:.1f}" for role, v in roles.items())
                     for name, roles in result.idle_ms_per_s.items())
    console.print(f"idle CPU, ms per s: {idle}")
    t = Table(title="CPU per request, µs (router: per decision; node: per placed request; "
                    "the relay's relay and worker in those two columns)")
    for col in ("load", "path", "requests", "200/s", "refused 429", "p50 ms", "p99 ms",
                "router", "node", "echo", "nats-server"):
        t.add_column(col, justify="left" if col in ("load", "path") else "right")
    for m in result.rows:
        t.add_row(m.load, m.system, str(m.requests), f"{m.ok_per_s:.1f}",
                  f"{m.refused_share:.1%}", f"{m.p50_ms:.3f}", f"{m.p99_ms:.3f}",
                  *(_f(m.cpu_us.get(role)) for role in ("router", "node", "echo", "nats-server")))
    console.print(t)
    w = Table(title="Wake-ups per request (voluntary context switches, all threads; same "
                    "denominators)")
    for col in ("load", "path", "router", "node", "echo", "nats-server"):
        w.add_column(col, justify="left" if col in ("load", "path") else "right")
    for m in result.rows:
        w.add_row(m.load, m.system,
                  *(_f(m.wakes.get(role)) for role in ("router", "node", "echo", "nats-server")))
    console.print(w)
    fr = result.false_refusals
    console.print(f"false refusals (the plane, closed loop, one caller per slot): "
                  f"{fr.refused_share:.1%} of {fr.requests} {fr.reasons or ''}")
    for system in result.systems:
        pairs = result.pairs(system)
        r = Table(title=f"The {system} against the floor" + (
            " (the plane's targets, for comparison)" if system == "relay" else ""))
        r.add_column("ratio")
        r.add_column("target", justify="right")
        for f, _ in pairs:
            r.add_column(f.load, justify="right")
        for ratio in RATIOS:
            cells = []
            for f, p in pairs:
                v = ratio.of(f, p)
                cells.append("-" if v is None
                             else f"[{'green' if v <= ratio.target else 'red'}]{v:.2f}[/]")
            r.add_row(ratio.name, f"≤ {ratio.target:g}", *cells)
        console.print(r)
    fewest = min(ticks for m in result.rows for ticks in m.cpu_ticks.values())
    if fewest < 100:
        console.print(f"note: the smallest CPU reading was {fewest} ticks (± 1 tick each): "
                      "run longer (--duration, --requests) for finer figures")


def to_json(cfg: BenchConfig, result: Result) -> str:
    rows = [{**asdict(m), "ok_per_s": m.ok_per_s, "refused_share": m.refused_share}
            for m in result.rows]
    def ratios(system: str) -> list[dict[str, object]]:
        return [{"name": ratio.name, "target": ratio.target,
                 "by_load": {f.load: ratio.of(f, p) for f, p in result.pairs(system)}}
                for ratio in RATIOS]
    return json.dumps({
        "machine": {"arch": platform.machine(), "cores": os.cpu_count(),
                    "python": platform.python_version()},
        "config": asdict(cfg), "clk_tck": CLK_TCK,
        "idle_ms_per_s": result.idle_ms_per_s, "capacity_per_s": result.capacity_per_s,
        "false_refusal_share": result.false_refusals.refused_share,
        "rows": rows, "ratios": ratios("plane"),
        "relay_ratios": ratios("relay") if cfg.relay else None}, indent=1)


@click.command()
@click.option("--duration", "duration_s", type=float, default=20.0, show_default=True,
              help="Seconds per load and path (unless --requests).")
@click.option("--requests", type=int, default=None,
              help="Requests per load and path instead of --duration.")
@click.option("--slots", type=int, default=4, show_default=True)
@click.option("--work-us", type=int, default=0, show_default=True,
              help="`calibrated` duration_us of each request.")
@click.option("--deadline-ms", type=int, default=1000, show_default=True)
@click.option("--open-factor", type=float, default=0.9, show_default=True,
              help="Open-loop rate as a share of the plane's closed-loop capacity.")
@click.option("--warmup", type=int, default=500, show_default=True,
              help="Requests per path before measuring.")
@click.option("--idle", "idle_s", type=float, default=5.0, show_default=True,
              help="Seconds of idle CPU measured before the loads.")
@click.option("--settle", "settle_s", type=float, default=2.0, show_default=True,
              help="Seconds of quiet before each load and path.")
@click.option("--node-processes", type=int, default=1, show_default=True,
              help="`plane node --processes`: the slots over this many node processes.")
@click.option("--routers", type=click.IntRange(1, 8), default=1, show_default=True,
              help="`plane router` processes (one queue group); the router's figure is all "
                   "of theirs per decision, forwards between them included.")
@click.option("--relay", is_flag=True,
              help="Also measure the depth-one relay (depth_one_relay.py): the plane's "
                   "messages with none of its code.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object, not tables.")
def main(duration_s: float, requests: int | None, slots: int, work_us: int, deadline_ms: int,
         open_factor: float, warmup: int, idle_s: float, settle_s: float, node_processes: int,
         routers: int, relay: bool, as_json: bool) -> None:
    """CPU per request of the plane's router, node and nats-server against a bare echo."""
    cfg = BenchConfig(slots=slots, work_us=work_us, deadline_ms=deadline_ms,
                      requests=requests, duration_s=duration_s, open_factor=open_factor,
                      warmup=warmup, idle_s=idle_s, settle_s=settle_s,
                      node_processes=node_processes, routers=routers, relay=relay)
    with tempfile.TemporaryDirectory(prefix="plane-cpu-") as tmp:
        try:
            result = run(bench(cfg, Path(tmp)))
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from None
    if as_json:
        click.echo(to_json(cfg, result))
    else:
        console = Console()
        print_tables(cfg, result, console if console.is_terminal else Console(width=160))


if __name__ == "__main__":
    main()
