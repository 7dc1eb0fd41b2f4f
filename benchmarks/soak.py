"""A soak: 0.9x and 2x the capacity in turn, processes killed and settings changed under it,
one burst; every request answered exactly once, RSS flat, p99 back soon after the burst.

    .venv/bin/python benchmarks/soak.py [--duration 600] [--phase-s 30] [--chaos-every-s 60]
                                        [--burst 20000] [--work-us 5000] [--json PATH]
    short check: --duration 60 --phase-s 10 --chaos-every-s 15 --burst 2000

What runs, all on 127.0.0.1 and each stopped by its PID at the end (Ctrl-C and errors too):
a nats-server (EmbeddedNats), `plane router` r1 and r2 and `plane node --model calibrated
--slots 2 --backend torch` n1..n3, each its own process, and this process as the callers.

- Capacity first: closed loop, one SDK caller per slot (`overload_2x.capacity`), 5 s.
- Load, open loop: Poisson arrivals at 0.9x the capacity, then 2x, in turn every --phase-s.
  Each request goes out with its own reply subject (tests/ledger.py's idea, kept compact:
  a soak sends about a million), so a second answer, or none, is seen. A caller refused 429
  `busy` (or 503 by the plane) comes back as `plane.contract.backoff.retry_delay_ms` says, with its
  ticket or Plane-Avoid-Node, within its 1000 ms deadline: each retry is a new request.
- Chaos every --chaos-every-s, in turn: SIGTERM a node, SIGKILL a node, SIGTERM a router,
  SIGKILL a router (n1/n2 and r1/r2 take turns; n3 is never touched); the process is started
  again with the same id 1 s after it exited, and the time until the plane is whole again
  (every router counts every slot healthy) is recorded. Half a period later a live setting
  changes in PLANE_CONFIG (deadline_ms.calibrated 500 / 1000, probe_ms 200 / 100); the third
  change is invalid (deadline_ms.calibrated = -5): it must change nothing (a caller that sends
  no deadline header is still served 200, routers still count every slot healthy); the last
  valid value is put back after the check, whatever it showed.
- One burst of --burst requests published as fast as possible, at the quietest moment near
  the middle (farthest from any chaos event and load change).

What is recorded: every request's answers; accepted latency (send to first answer, of 200s)
per 5 s window; VmRSS of every process each 5 s; every event, with what the requests sent in
the 5 s after it got (other than 200 and 429); JetStream consumers before and after.
Verdicts (the exit status is 1 when one fails, 130 when interrupted):
- exactly once: no request answered twice, none unanswered, except those sent at most their
  deadline before a router was SIGKILLed (a request NATS handed to the dying router is lost
  with it: counted apart, "lost at router kill"); NATS no-responders replies counted apart.
- RSS flat: mean VmRSS of the last minute within 10% of the first minute, for every router
  and node process that lived at least 3 minutes (minute: min(60 s, duration / 6); a process
  started during the soak counts from 15 s after its start). A step at the burst (buffers
  grown to carry it, kept by the allocator) counts too: `rss_samples` in the JSON shows it.
- p99 recovered: the p99 of the 10 s before the burst, against sliding 5 s windows after the
  burst's last publish (by send time): the first one at most 1.2x that p99 starts within 5 s.
- the invalid setting changed nothing; no plane process exited by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import functools
import heapq
import json
import math
import operator
import os
import platform
import random
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.children import until  # noqa: E402
from benchmarks.overload_2x import capacity  # noqa: E402
from plane.client.result import header_int  # noqa: E402
from plane.contract.backoff import RetryPolicy, retry_delay_ms  # noqa: E402
from plane.contract.embedded import EmbeddedNats  # noqa: E402
from plane.contract.lifecycle import run  # noqa: E402
from plane.contract.messages import FINAL_REFUSALS, Status  # noqa: E402
from plane.contract.processes import die_with_parent, stop_by_pid  # noqa: E402
from plane.contract.quantiles import quantile  # noqa: E402
from plane.contract.subjects import Header, Names  # noqa: E402

BIN = Path(sys.executable).parent
MODEL = "calibrated"
DEADLINE_MS = 1000
WINDOW_S = 5.0
PRE_BURST_S = 10.0
RECOVERED_WITHIN_S = 5.0
RECOVERED_RATIO = 1.2
RSS_TOLERANCE = 0.10
WARMUP_S = 15.0
AFTERMATH_S = 5.0
NO_RESPONDERS = -503  # NATS's own 503: nobody subscribed to the subject
EXIT_OK, EXIT_VERDICT_FAILED, EXIT_INTERRUPTED = 0, 1, 130
NAMES = Names()
SETTINGS = [("deadline_ms.calibrated", 500), ("probe_ms", 200),
            ("deadline_ms.calibrated", 1000), ("probe_ms", 100)]
INVALID = ("deadline_ms.calibrated", -5)
PROCESS_EVENTS = [("node", signal.SIGTERM), ("node", signal.SIGKILL),
                  ("router", signal.SIGTERM), ("router", signal.SIGKILL)]


# -- the plane's processes ------------------------------------------------------------------
@dataclass
class Life:
    """One run of a process: from its start to its end, on the soak clock."""

    pid: int
    started_s: float
    ended_s: float | None = None
    ended_by: str = ""
    rc: int | None = None


class Member:
    """A plane process that chaos stops and starts again under the same id."""

    def __init__(self, name: str, args: list[str], log: Path, clock: Callable[[], float]):
        self.name, self.args, self.log, self.clock = name, args, log, clock
        self.proc: asyncio.subprocess.Process | None = None
        self.stopping = False
        self.lives: list[Life] = []

    async def start(self) -> None:
        with self.log.open("ab") as f:
            self.proc = await asyncio.create_subprocess_exec(
                *self.args, stdin=asyncio.subprocess.DEVNULL, stdout=f, stderr=f, cwd=REPO,
                preexec_fn=die_with_parent)
        self.lives.append(Life(pid=self.proc.pid, started_s=self.clock()))

    async def stop(self, sig: signal.Signals = signal.SIGTERM, why: str = "") -> None:
        proc = self.proc
        if proc is None:
            return
        self.stopping = True
        try:  # interrupted, it stays ours to stop at the end
            await stop_by_pid(proc, kill=sig == signal.SIGKILL, timeout_s=30)
        finally:
            self.stopping = False
        self.proc = None
        life = self.lives[-1]
        life.ended_s, life.rc, life.ended_by = self.clock(), proc.returncode, why or sig.name

    def exited_by_itself(self) -> bool:
        return self.proc is not None and not self.stopping and self.proc.returncode is not None


# -- the callers and their ledger -------------------------------------------------------------
class Calls:
    """Every request sent, each with its own reply subject, and every answer it got."""

    def __init__(self, nc: NATS, body: bytes, clock: Callable[[], float], seed: int) -> None:
        self.nc, self.body, self.clock = nc, body, clock
        self.rng = random.Random(seed)
        self.policy = RetryPolicy()
        self.inbox = ""
        self.sent_s: list[float] = []  # when it was due to go (arrivals: the Poisson time)
        self.chain: list[int] = []  # id of the chain's first request (a retry continues one)
        self.attempt: list[int] = []
        self.deadline_ms: list[int] = []
        self.burst: list[bool] = []
        self.answered_s: list[float] = []  # first answer (nan: none yet)
        self.status: list[int] = []  # first answer's Plane-Status (0: none yet)
        self.reason: list[str] = []
        self.answers: list[int] = []
        self.second: list[dict[str, Any]] = []  # every answer after the first
        self.retries: list[tuple[float, int]] = []  # heap of (due, request to retry)
        self._ticket: dict[int, str] = {}  # chain -> the ticket it holds, as the SDK keeps it
        self._avoid: dict[int, str] = {}  # chain -> the node that last answered it 503
        self.late_10ms = 0  # arrivals published more than 10 ms after their Poisson time
        self.late_max_s = 0.0

    async def start(self) -> None:
        self.inbox = self.nc.new_inbox()
        await self.nc.subscribe(f"{self.inbox}.*", cb=self._on_answer)

    async def send(self, due_s: float, *, prev: int | None = None, burst: bool = False) -> None:
        """Send a new caller's request (`prev` None) or the retry of request `prev`."""
        i = len(self.sent_s)
        first = i if prev is None else self.chain[prev]
        left_ms = max(1, int(DEADLINE_MS - (due_s - self.sent_s[first]) * 1000)) if prev \
            is not None else DEADLINE_MS
        attempt = 1 if prev is None else self.attempt[prev] + 1
        headers = {Header.DEADLINE_MS: str(left_ms),
                   Header.REQUEST_ID: f"soak-{first}", Header.ATTEMPT: str(attempt)}
        if first in self._ticket:
            headers[Header.TICKET] = self._ticket[first]
        if first in self._avoid:
            headers[Header.AVOID_NODE] = self._avoid[first]
        self.sent_s.append(due_s)
        self.chain.append(first)
        self.attempt.append(attempt)
        self.deadline_ms.append(left_ms)
        self.burst.append(burst)
        self.answered_s.append(math.nan)
        self.status.append(0)
        self.reason.append("")
        self.answers.append(0)
        await self.nc.publish(NAMES.infer(MODEL), self.body, reply=f"{self.inbox}.{i}",
                              headers=headers)

    async def _on_answer(self, msg: Msg) -> None:
        now = self.clock()
        i = int(msg.subject.rpartition(".")[2])
        h = msg.headers or {}
        status = header_int(h, Header.STATUS) or (NO_RESPONDERS if h.get("Status") == "503"
                                                    else int(Status.OK))
        reason = h.get(Header.REASON, "")
        self.answers[i] += 1
        if self.answers[i] > 1:
            self.second.append({
                "id": i, "sent_s": self.sent_s[i], "attempt": self.attempt[i],
                "first": [self.answered_s[i], self.status[i], self.reason[i]],
                "again": [now, status, reason], "node": h.get(Header.NODE, "")})
            return
        self.answered_s[i], self.status[i], self.reason[i] = now, status, reason
        first = self.chain[i]
        busy = status == Status.BUSY and reason not in FINAL_REFUSALS
        if not (busy or status == Status.UNAVAILABLE):  # the SDK retries only these
            return
        if busy and Header.TICKET in h:
            self._ticket[first] = h[Header.TICKET]
        if status == Status.UNAVAILABLE and Header.NODE in h:
            self._avoid[first] = h[Header.NODE]
        delay_ms = retry_delay_ms(
            self.policy, attempt=self.attempt[i],
            remaining_ms=(self.sent_s[first] + DEADLINE_MS / 1000 - now) * 1000,
            u=self.rng.random(), retry_after_ms=header_int(h, Header.RETRY_AFTER_MS) if busy
            else None, server_time_ms=header_int(h, Header.SERVER_TIME),
            local_time_ms=time.time_ns() // 1_000_000)
        if delay_ms is not None:
            heapq.heappush(self.retries, (now + delay_ms / 1000, i))

    def unanswered(self) -> list[int]:
        return [i for i, n in enumerate(self.answers) if n == 0]


# -- the schedule -----------------------------------------------------------------------------
@dataclass(frozen=True)
class Plan:
    duration_s: float
    phase_s: float
    chaos_every_s: float
    burst: int

    def factor(self, t_s: float) -> float:
        return 0.9 if int(t_s // self.phase_s) % 2 == 0 else 2.0

    def process_events(self) -> list[tuple[float, str, signal.Signals]]:
        ticks = range(1, int(self.duration_s / self.chaos_every_s) + 1)
        events = [(k * self.chaos_every_s, *PROCESS_EVENTS[(k - 1) % len(PROCESS_EVENTS)])
                  for k in ticks]
        return [e for e in events if e[0] < self.duration_s]

    def setting_changes(self) -> list[tuple[float, str, int]]:
        times = [(k + 0.5) * self.chaos_every_s
                 for k in range(int(self.duration_s / self.chaos_every_s) + 1)]
        times = [t for t in times if t < self.duration_s]
        # The third change is the invalid one; the valid ones go round in order around it.
        values = [INVALID if n == 2 else SETTINGS[(n - (n > 2)) % len(SETTINGS)]
                  for n in range(len(times))]
        return [(t, key, value) for t, (key, value) in zip(times, values, strict=True)]

    def burst_at_s(self) -> float:
        """The quietest moment in the middle third: farthest from any event or change of
        load (ties: at 0.9x, then nearest the middle)."""
        marks = [t for t, *_ in self.process_events()] + [t for t, *_ in self.setting_changes()]
        marks += [k * self.phase_s for k in range(1, int(self.duration_s / self.phase_s) + 1)]
        grid = [self.duration_s / 3 + 0.25 * n for n in range(int(self.duration_s / 3 / 0.25))]
        return max(grid, key=lambda t: (
            round(min((abs(t - m) for m in marks), default=math.inf), 1),
            self.factor(t) < 1, -abs(t - self.duration_s / 2)))


class Clock:
    """Seconds since the soak's load began (negative before)."""

    def __init__(self) -> None:
        self.base = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.base


# -- what runs during the soak ----------------------------------------------------------------
async def offer(calls: Calls, cap: float, plan: Plan, clock: Clock) -> dict[str, float]:
    """Open-loop arrivals and due retries until the end, then the last retries; the burst
    when its time comes."""
    rng = random.Random(2)
    arrival = 0.0
    burst_at = plan.burst_at_s() if plan.burst else math.inf
    burst: dict[str, float] = {}
    last_s = plan.duration_s + DEADLINE_MS / 1000 + 0.5
    while (now := clock()) < last_s or calls.retries:
        while calls.retries and calls.retries[0][0] <= now:
            due, prev = heapq.heappop(calls.retries)
            await calls.send(due, prev=prev)
        while arrival <= now and arrival < plan.duration_s:
            calls.late_max_s = max(calls.late_max_s, now - arrival)
            calls.late_10ms += now - arrival > 0.010
            await calls.send(arrival)
            arrival += rng.expovariate(plan.factor(arrival) * cap)
        if now >= burst_at and not burst:
            burst["start_s"] = clock()
            for _ in range(plan.burst):
                await calls.send(clock(), burst=True)
            burst["end_s"] = clock()
        await asyncio.sleep(0.002)  # retries come from answers: look again soon
    return burst


async def healthy_slots(nc: NATS, router: str) -> int | None:
    """How many calibrated slots `router` counts healthy (None: it does not answer)."""
    try:
        msg = await nc.request(NAMES.router_status(router), b"", timeout=0.5)
        return int(json.loads(msg.data)["models"].get(MODEL, {}).get("healthy", 0))
    except (nats.errors.Error, TimeoutError, ValueError, KeyError):
        return None


async def whole(nc: NATS, routers: list[Member], total_slots: int) -> bool:
    """Every router answers and counts every slot healthy."""
    return all([await healthy_slots(nc, r.name) == total_slots for r in routers])


async def whole_after_s(nc: NATS, routers: list[Member], total: int, clock: Clock,
                        timeout_s: float = 30.0) -> float | None:
    t0 = clock()
    while clock() - t0 < timeout_s:
        if await whole(nc, routers, total):
            return clock() - t0
        await asyncio.sleep(0.1)
    return None


async def served_without_deadline_header(nc: NATS, body: bytes) -> list[int]:
    """Statuses a caller that sends no Plane-Deadline-Ms (the live setting decides its
    deadline) gets, trying for up to 5 s, until its first 200. Under 2x load many tries are
    refused (`deadline` too): a 200 at all says the setting in force is a usable one."""
    statuses: list[int] = []
    headers = {Header.REQUEST_ID: "soak-no-deadline-header"}
    t_end = time.monotonic() + 5
    while time.monotonic() < t_end and statuses[-1:] != [200]:
        try:
            msg = await nc.request(NAMES.infer(MODEL), body, timeout=3, headers=headers)
        except (nats.errors.Error, TimeoutError):
            statuses.append(0)
            continue
        h = msg.headers or {}
        statuses.append(header_int(h, Header.STATUS) or 200)
        headers.pop(Header.TICKET, None)
        if Header.TICKET in h:
            headers[Header.TICKET] = h[Header.TICKET]
        await asyncio.sleep((header_int(h, Header.RETRY_AFTER_MS) or 100) / 1000)
    return statuses


@dataclass
class Chaos:
    nc: NATS
    plan: Plan
    clock: Clock
    body: bytes
    nodes: list[Member]  # the two that take turns (the third is never touched)
    routers: list[Member]
    total_slots: int
    events: list[dict[str, Any]] = field(default_factory=list)
    last_valid: dict[str, int] = field(default_factory=dict)
    turns: Counter[tuple[str, signal.Signals]] = field(default_factory=Counter)

    async def run(self) -> None:
        todo: list[tuple[float, Callable[[], Awaitable[dict[str, Any]]]]] = [
            (t, functools.partial(self.bounce, kind, sig, t))
            for t, kind, sig in self.plan.process_events()]
        todo += [(t, functools.partial(self.change, key, value, t))
                 for t, key, value in self.plan.setting_changes()]
        for at_s, act in sorted(todo, key=operator.itemgetter(0)):
            await asyncio.sleep(max(0.0, at_s - self.clock()))
            self.events.append(await act())

    async def bounce(self, kind: str, sig: signal.Signals, planned_s: float) -> dict[str, Any]:
        """Stop a node or router with `sig` (they take turns), start it again 1 s later."""
        group = self.nodes if kind == "node" else self.routers
        victim = group[(self.turns[kind, sig] + (sig == signal.SIGKILL)) % len(group)]
        self.turns[kind, sig] += 1
        ev: dict[str, Any] = {"at_s": self.clock(), "planned_s": planned_s,
                              "event": f"{sig.name} {kind}", "target": victim.name,
                              "pid": victim.proc.pid if victim.proc else None}
        await victim.stop(sig)
        life = victim.lives[-1]
        ev["exited_after_s"], ev["rc"] = (life.ended_s or 0) - ev["at_s"], life.rc
        await asyncio.sleep(1.0)
        await victim.start()
        ev["restarted_s"], ev["new_pid"] = self.clock(), victim.lives[-1].pid
        ev["whole_after_restart_s"] = await whole_after_s(self.nc, self.routers,
                                                          self.total_slots, self.clock)
        return ev

    async def change(self, key: str, value: int, planned_s: float) -> dict[str, Any]:
        kv = await self.nc.jetstream().key_value(NAMES.config_bucket)
        ev: dict[str, Any] = {"at_s": self.clock(), "planned_s": planned_s,
                              "event": "setting" if value > 0 else "invalid setting",
                              "target": f"{key}={value}"}
        await kv.put(key, str(value).encode())
        if value > 0:
            self.last_valid[key] = value
            return ev
        await asyncio.sleep(1.5)  # routers and nodes follow a change within about a second
        ev["statuses_without_deadline_header"] = await served_without_deadline_header(
            self.nc, self.body)
        ev["routers_see_every_slot"] = await whole(self.nc, self.routers, self.total_slots)
        ev["changed_nothing"] = (200 in ev["statuses_without_deadline_header"]
                                 and ev["routers_see_every_slot"])
        if key in self.last_valid:  # put back, whatever the check showed
            await kv.put(key, str(self.last_valid[key]).encode())
        else:
            await kv.delete(key)
        return ev


def rss_kb(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return None


async def watch(members: list[Member], others: dict[str, int], clock: Clock,
                samples: list[tuple[float, str, int, int]], crashes: list[dict[str, Any]]
                ) -> None:
    """Every 5 s: VmRSS of every process; a plane process that exited by itself is noted
    and started again (the soak goes on; the verdict fails)."""
    while True:
        t = clock()
        pids = {m.name: m.proc.pid for m in members if m.proc and m.proc.returncode is None}
        for name, pid in [*pids.items(), *others.items()]:
            if (kb := rss_kb(pid)) is not None:
                samples.append((t, name, pid, kb))
        for m in members:
            if m.exited_by_itself():
                assert m.proc is not None
                crashes.append({"at_s": t, "target": m.name, "pid": m.proc.pid,
                                "rc": m.proc.returncode})
                await m.stop(why=f"exited by itself, rc {m.proc.returncode}")
                await m.start()
        await asyncio.sleep(WINDOW_S)


async def consumers(nc: NATS) -> dict[str, list[str]]:
    """Each stream's consumers (restarts that leak consumers show here)."""
    js = nc.jetstream()
    out: dict[str, list[str]] = {}
    for s in await js.streams_info():
        name = s.config.name or ""
        out[name] = sorted(c.name for c in await js.consumers_info(name))
    return out


# -- what it came to --------------------------------------------------------------------------
def label(status: int, reason: str) -> str:
    if status == NO_RESPONDERS:
        return "no responders (NATS)"
    return "200" if status == Status.OK else f"{status} {reason}".strip()


def ms(xs: list[float], q: float) -> float:
    return quantile(xs, q) * 1000


def by_window(calls: Calls, plan: Plan, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    n = math.ceil(plan.duration_s / WINDOW_S)
    rows: list[dict[str, Any]] = [
        {"start_s": k * WINDOW_S, "load": plan.factor(k * WINDOW_S), "sent": 0, "retries": 0,
         "burst": 0, "200": 0, "429": 0, "other": 0, "unanswered": 0, "twice": 0, "lat": []}
        for k in range(n)]
    for i, sent in enumerate(calls.sent_s):
        row = rows[min(n - 1, max(0, int(sent // WINDOW_S)))]  # the last retries: last window
        row["sent"] += 1
        row["retries"] += calls.attempt[i] > 1
        row["burst"] += calls.burst[i]
        row["twice"] += calls.answers[i] > 1
        if calls.answers[i] == 0:
            row["unanswered"] += 1
        elif calls.status[i] == Status.OK:
            row["200"] += 1
            row["lat"].append(calls.answered_s[i] - sent)
        else:
            row["429" if calls.status[i] == Status.BUSY else "other"] += 1
    for row in rows:
        lat = row.pop("lat")
        row["p50_ms"], row["p99_ms"] = ms(lat, 0.5), ms(lat, 0.99)
        row["events"] = [f"{e['event']} {e['target']}" for e in events
                         if row["start_s"] <= e["at_s"] < row["start_s"] + WINDOW_S]
    return rows


def ledger(calls: Calls, events: list[dict[str, Any]]) -> dict[str, Any]:
    kills = [e["at_s"] for e in events if e["event"] == "SIGKILL router"]

    def nearest(t: float) -> str:
        e = min(events, key=lambda e: abs(e["at_s"] - t), default=None)
        return "" if e is None else f"{e['event']} {e['target']} at {e['at_s']:.2f} s"

    def detail(i: int) -> dict[str, Any]:
        return {"id": i, "sent_s": round(calls.sent_s[i], 4), "attempt": calls.attempt[i],
                "burst": calls.burst[i], "nearest_event": nearest(calls.sent_s[i])}

    missing = calls.unanswered()
    at_kill = {i for i in missing if any(
        calls.sent_s[i] - 0.05 <= k <= calls.sent_s[i] + calls.deadline_ms[i] / 1000 + 0.25
        for k in kills)}
    last: dict[int, int] = {}
    for i, first in enumerate(calls.chain):
        last[first] = i
    return {
        "requests": len(calls.sent_s), "callers": len(last),
        "retries": sum(a > 1 for a in calls.attempt), "burst": sum(calls.burst),
        "answered_once": sum(n == 1 for n in calls.answers),
        "answered_twice_or_more": sum(n > 1 for n in calls.answers),
        "unanswered": len(missing), "lost_at_router_kill": len(at_kill),
        "unanswered_unexplained": len(missing) - len(at_kill),
        "first_answers": dict(Counter(label(calls.status[i], calls.reason[i])
                                      for i, n in enumerate(calls.answers) if n).most_common()),
        "callers_ended": dict(Counter(
            label(calls.status[i], calls.reason[i]) if calls.answers[i] else "unanswered"
            for i in last.values()).most_common()),
        "unanswered_detail": [detail(i) | {"lost_at_router_kill": i in at_kill}
                              for i in missing[:1000]],
        "twice_detail": [detail(d["id"]) | d for d in calls.second[:1000]],
        "arrivals_late_over_10ms": calls.late_10ms, "arrival_late_max_s": calls.late_max_s,
    }


def aftermath(calls: Calls, events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each event (in time order): what the requests sent within AFTERMATH_S after it
    got, 200s and 429s left out."""
    times = [e["at_s"] for e in events]
    seen: list[Counter[str]] = [Counter() for _ in events]
    span: list[list[float]] = [[] for _ in events]  # their send times after the event
    for i, sent in enumerate(calls.sent_s):
        if calls.answers[i] and calls.status[i] in (Status.OK, Status.BUSY):
            continue
        j = bisect.bisect_right(times, sent) - 1
        while j >= 0 and sent - times[j] < AFTERMATH_S:
            seen[j][label(calls.status[i], calls.reason[i]) if calls.answers[i]
                    else "unanswered"] += 1
            span[j].append(sent - times[j])
            j -= 1
    return [dict(c.most_common()) | ({"sent_s_after": [round(min(s), 2), round(max(s), 2)]}
                                      if s else {}) for c, s in zip(seen, span, strict=True)]


def burst_recovery(calls: Calls, burst: dict[str, float]) -> dict[str, Any]:
    if not burst:
        return {}
    b0, b1 = burst["start_s"], burst["end_s"]
    accepted = [(s, calls.answered_s[i] - s) for i, s in enumerate(calls.sent_s)
                if calls.status[i] == Status.OK and not calls.burst[i]]
    pre = [lat for s, lat in accepted if b0 - PRE_BURST_S <= s < b0]
    pre_p99 = ms(pre, 0.99)
    after = [(s, lat) for s, lat in accepted if b1 <= s < b1 + 31 + WINDOW_S]
    trail: list[dict[str, float]] = []
    recovered_after_s = None
    for off in range(31):
        w = [lat for s, lat in after if b1 + off <= s < b1 + off + WINDOW_S]
        if len(w) < 20:
            continue
        trail.append({"after_s": off, "p99_ms": ms(w, 0.99), "n": len(w)})
        if recovered_after_s is None and trail[-1]["p99_ms"] <= RECOVERED_RATIO * pre_p99:
            recovered_after_s = off
    ids = [i for i, b in enumerate(calls.burst) if b]
    done = [calls.answered_s[i] for i in ids if calls.answers[i]]
    return {
        "requests": len(ids), "start_s": b0, "published_in_s": b1 - b0,
        "answers": dict(Counter(label(calls.status[i], calls.reason[i]) if calls.answers[i]
                                else "unanswered" for i in ids).most_common()),
        "last_answer_after_s": (max(done) - b0) if done else None,
        "pre_p99_ms": pre_p99, "pre_n": len(pre), "windows_after": trail,
        "recovered_after_s": recovered_after_s,
    }


def rss(samples: list[tuple[float, str, int, int]], plan: Plan,
        members: list[Member]) -> tuple[float, list[dict[str, Any]]]:
    """Per process run: mean VmRSS of its first and last minute (min(60 s, duration / 6)).
    A process started during the soak is taken from WARMUP_S after its start (torch's
    import alone adds 70 MB to a node in its first seconds)."""
    minute = min(60.0, plan.duration_s / 6)
    warm_s = {life.pid: life.started_s + WARMUP_S for m in members for life in m.lives
              if life.started_s > 0}
    runs: dict[tuple[str, int], list[tuple[float, int]]] = {}
    for t, name, pid, kb in samples:
        if t >= warm_s.get(pid, -math.inf):
            runs.setdefault((name, pid), []).append((t, kb))
    rows = []
    for (name, pid), xs in runs.items():
        t_first, t_last = xs[0][0], xs[-1][0]
        first = statistics.fmean(kb for t, kb in xs if t < t_first + minute) / 1024
        last = statistics.fmean(kb for t, kb in xs if t > t_last - minute) / 1024
        rows.append({"process": name, "pid": pid, "from_s": t_first, "to_s": t_last,
                     "first_mb": first, "last_mb": last, "change": last / first - 1,
                     "judged": name in {m.name for m in members}
                     and t_last - t_first >= 3 * minute})
    return minute, rows


def report(r: dict[str, Any]) -> list[tuple[str, bool | None]]:
    """Print the tables; return the verdicts (None: not measured)."""
    a, led, b = r["args"], r["ledger"], r["burst"]
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; {a['routers']} routers, {a['nodes']} nodes x "
          f"{a['slots']} slots, calibrated {a['work_us']} us, deadline {DEADLINE_MS} ms")
    print(f"capacity (closed loop, {a['nodes'] * a['slots']} callers, {a['capacity_s']:.0f} s): "
          f"{r['capacity']:.1f} req/s; offered 0.9x = {0.9 * r['capacity']:.0f}/s and 2x = "
          f"{2 * r['capacity']:.0f}/s in turn every {a['phase_s']:.0f} s for "
          f"{a['duration']:.0f} s; logs: {r['logs']}\n")
    print("| window s | load | sent | retries | 200 | 429 | other | unanswered | twice | "
          "p50 ms | p99 ms | events |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for w in r["windows"]:
        burst = [f"burst {w['burst']}"] if w["burst"] else []
        print(f"| {w['start_s']:.0f} | {w['load']}x | {w['sent']} | {w['retries']} | "
              f"{w['200']} | {w['429']} | {w['other']} | {w['unanswered']} | {w['twice']} | "
              f"{w['p50_ms']:.1f} | {w['p99_ms']:.1f} | {'; '.join(burst + w['events'])} |")
    print(f"\n| at s | event | target | pid | exited after s | rc | whole again after "
          f"restart, s | sent in the {AFTERMATH_S:.0f} s after: not 200 or 429 |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for e in r["events"]:
        if "pid" in e:
            back = e["whole_after_restart_s"]
            print(f"| {e['at_s']:.1f} | {e['event']} | {e['target']} | {e['pid']} -> "
                  f"{e['new_pid']} | {e['exited_after_s']:.2f} | {e['rc']} | "
                  f"{'never (30 s)' if back is None else f'{back:.1f}'} | {e['aftermath']} |")
        else:
            check = (f"; no-deadline-header caller got {e['statuses_without_deadline_header']}"
                     f", routers see every slot: {e['routers_see_every_slot']}"
                     if "changed_nothing" in e else "")
            print(f"| {e['at_s']:.1f} | {e['event']} | {e['target']}{check} | | | | | "
                  f"{e['aftermath']} |")
    print(f"\nrequests: {led['requests']} ({led['callers']} callers, {led['retries']} retries, "
          f"{led['burst']} in the burst); first answers: {led['first_answers']}")
    print(f"callers ended: {led['callers_ended']}")
    print(f"arrivals published over 10 ms late: {led['arrivals_late_over_10ms']} "
          f"(max {led['arrival_late_max_s'] * 1000:.0f} ms)")
    for d in led["twice_detail"][:20]:
        print(f"  answered twice: {d}")
    for d in led["unanswered_detail"][:20]:
        print(f"  unanswered: {d}")
    print("JetStream consumers per stream, before -> after: " + ", ".join(
        f"{name} {len(r['consumers_before'].get(name, []))} -> {len(after)}"
        for name, after in r["consumers_after"].items()))
    for c in r["crashes"]:
        print(f"  exited by itself: {c}")
    print(f"\nRSS (first vs last {r['rss_minute_s']:.0f} s of each process run; judged: "
          "routers and nodes that ran at least 3 of those)")
    print("| process | pid | from s | to s | first MB | last MB | change | judged |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for x in r["rss"]:
        print(f"| {x['process']} | {x['pid']} | {x['from_s']:.0f} | {x['to_s']:.0f} | "
              f"{x['first_mb']:.1f} | {x['last_mb']:.1f} | {x['change']:+.1%} | "
              f"{'yes' if x['judged'] else 'no'} |")
    if b:
        trail = ", ".join(f"+{w['after_s']} s: {w['p99_ms']:.1f}" for w in b["windows_after"][:8])
        print(f"\nburst: {b['requests']} requests published at {b['start_s']:.1f} s in "
              f"{b['published_in_s']:.2f} s; answers {b['answers']}; last answer "
              f"{b['last_answer_after_s']} s after it began")
        print(f"p99 before (the {PRE_BURST_S:.0f} s before, {b['pre_n']} accepted): "
              f"{b['pre_p99_ms']:.1f} ms; 5 s windows from the burst's last publish: {trail}")
    judged = [x for x in r["rss"] if x["judged"]]
    worst = max(judged, key=lambda x: abs(x["change"]), default=None)
    invalid = [e for e in r["events"] if "changed_nothing" in e]
    rec = b.get("recovered_after_s") if b else None
    verdicts: list[tuple[str, bool | None]] = [
        (f"exactly-once held: {led['requests']} requests, {led['answered_twice_or_more']} "
         f"answered twice, {led['unanswered_unexplained']} unanswered (apart: "
         f"{led['lost_at_router_kill']} unanswered sent within their deadline of a router "
         f"SIGKILL, {led['first_answers'].get('no responders (NATS)', 0)} NATS "
         "no-responders)",
         led["answered_twice_or_more"] == 0 and led["unanswered_unexplained"] == 0),
        (f"RSS flat ±{RSS_TOLERANCE:.0%}: {len(judged)} process runs judged, worst "
         + (f"{worst['process']} {worst['change']:+.1%}" if worst else "none"),
         bool(judged) and all(abs(x["change"]) <= RSS_TOLERANCE for x in judged)),
        (f"p99 recovered within {RECOVERED_WITHIN_S:.0f} s of the burst: "
         + ("no burst" if not b else "never (30 s)" if rec is None else f"after {rec} s"),
         None if not b else rec is not None and rec <= RECOVERED_WITHIN_S),
        (f"invalid setting changed nothing: {len(invalid)} tried",
         None if not invalid else all(e["changed_nothing"] for e in invalid)),
        (f"no plane process exited by itself: {len(r['crashes'])} did", not r["crashes"]),
    ]
    print()
    for text, ok in verdicts:
        print(f"- [{' ' if ok is False else 'x' if ok else '-'}] "
              f"{'yes' if ok else 'no' if ok is False else 'n/a'}: {text}")
    return verdicts


def parse() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--duration", type=float, default=600.0, help="seconds of load")
    ap.add_argument("--phase-s", type=float, default=30.0, help="0.9x and 2x take turns")
    ap.add_argument("--chaos-every-s", type=float, default=60.0)
    ap.add_argument("--burst", type=int, default=20_000, help="requests in the burst (0: none)")
    ap.add_argument("--work-us", type=int, default=5000)
    ap.add_argument("--routers", type=int, default=2)
    ap.add_argument("--nodes", type=int, default=3, help="the first two take turns at chaos")
    ap.add_argument("--slots", type=int, default=2)
    ap.add_argument("--capacity-s", type=float, default=5.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--logs", type=Path, help="directory for the processes' logs (default: new)")
    ap.add_argument("--json", type=Path, help="write everything measured here")
    args = ap.parse_args()
    if args.routers < 2 or args.nodes < 2:
        ap.error("chaos needs at least 2 routers and 2 nodes")
    if args.slots < 1 or args.duration < 3 * args.phase_s:
        ap.error("--slots must be at least 1, --duration at least 3 phases")
    args.logs = args.logs or Path(tempfile.mkdtemp(prefix="plane-soak-"))
    args.logs.mkdir(parents=True, exist_ok=True)
    return args


async def main() -> int:
    args = parse()
    plan = Plan(args.duration, args.phase_s, args.chaos_every_s, args.burst)
    logs: Path = args.logs
    body = json.dumps({"duration_us": args.work_us}).encode()
    clock = Clock()
    total = args.nodes * args.slots
    async with EmbeddedNats() as srv:
        common = ["--nats", srv.url, "--log-level", "warning"]
        routers = [Member(f"r{k + 1}", [str(BIN / "plane"), "router", *common, "--router-id",
                                        f"r{k + 1}"], logs / f"r{k + 1}.log", clock)
                   for k in range(args.routers)]
        nodes = [Member(f"n{k + 1}", [str(BIN / "plane"), "node", *common, "--model", MODEL,
                                      "--slots", str(args.slots), "--backend", "torch",
                                      "--node-id", f"n{k + 1}"], logs / f"n{k + 1}.log", clock)
                 for k in range(args.nodes)]
        members = routers + nodes
        nc: NATS | None = None
        main_task = asyncio.current_task()
        assert main_task is not None  # SIGTERM unwinds like Ctrl-C: every process stopped
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, main_task.cancel)
        try:
            for m in members:
                await m.start()
            nc = await nats.connect(srv.url, name="soak")

            async def ready() -> bool:
                for m in members:
                    if m.exited_by_itself():
                        raise RuntimeError(f"{m.name} exited at start; its log, {m.log}:\n"
                                           + m.log.read_text(errors="replace")[-3000:])
                return await whole(nc, routers, total)

            await until("the plane (every router counting every slot healthy)", ready, 180,
                        nodes[-1].log)
            cap = await capacity(srv.url, body, total, args.capacity_s)
            shift = time.monotonic() - clock.base
            clock.base += shift
            for m in members:
                for life in m.lives:
                    life.started_s -= shift
            calls = Calls(nc, body, clock, args.seed)
            await calls.start()
            chaos = Chaos(nc, plan, clock, body, nodes[:2], routers, total)
            samples: list[tuple[float, str, int, int]] = []
            crashes: list[dict[str, Any]] = []
            before = await consumers(nc)
            async with asyncio.TaskGroup() as tg:
                watcher = tg.create_task(watch(members, {"nats-server": srv.pid or 0,
                                                         "caller": os.getpid()},
                                               clock, samples, crashes))
                chaos_task = tg.create_task(chaos.run())
                burst = await offer(calls, cap, plan, clock)
                await chaos_task
                watcher.cancel()
            t_end = max(calls.sent_s, default=0.0) + DEADLINE_MS / 1000 + 3
            while calls.unanswered() and clock() < t_end:
                await asyncio.sleep(0.2)
            await asyncio.sleep(1.0)  # a second answer would come now
            after = await consumers(nc)
        finally:
            await asyncio.gather(*(m.stop(why="end of soak") for m in members))
            if nc is not None:
                await nc.close()
    minute, rss_rows = rss(samples, plan, members)
    for e, seen in zip(chaos.events, aftermath(calls, chaos.events), strict=True):
        e["aftermath"] = seen
    result: dict[str, Any] = {
        "args": vars(args) | {"json": str(args.json), "logs": str(logs)}, "logs": str(logs),
        "capacity": cap, "burst_at_s": plan.burst_at_s() if args.burst else None,
        "events": chaos.events, "crashes": crashes, "windows": by_window(calls, plan,
                                                                         chaos.events),
        "ledger": ledger(calls, chaos.events), "burst": burst_recovery(calls, burst),
        "rss_minute_s": minute, "rss": rss_rows, "rss_samples": samples,
        "lives": {m.name: [asdict(life) for life in m.lives] for m in members},
        "consumers_before": before, "consumers_after": after,
    }
    verdicts = report(result)
    result["verdicts"] = [{"verdict": text, "ok": ok} for text, ok in verdicts]
    if args.json:
        args.json.write_text(json.dumps(result, indent=1, default=str))
        print(f"\nwritten: {args.json}")
    return EXIT_VERDICT_FAILED if any(ok is False for _, ok in verdicts) else EXIT_OK


if __name__ == "__main__":
    try:
        sys.exit(run(main()))
    except (KeyboardInterrupt, asyncio.CancelledError):  # Ctrl-C, SIGTERM
        print("interrupted: every process it started is stopped", file=sys.stderr)
        sys.exit(EXIT_INTERRUPTED)
