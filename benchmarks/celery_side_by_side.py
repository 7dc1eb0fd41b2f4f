"""The plane against Celery 5 + Redis, side by side, in one run.

Same compute per task (the `calibrated` model: hold a slot, or a Celery worker process, for D
µs), as many Celery worker processes as the plane has slots, and the same load generator for
both: `plane pulse`'s open-loop driver, latency from each request's scheduled send time. For
each system the capacity is measured first (closed loop, one caller per slot), then it is
offered 0.5x, 0.9x and 1.5x that capacity for --duration seconds each.

    .venv/bin/python benchmarks/celery_side_by_side.py --duration 60   # the table in BENCHMARKS.md

Needs redis-server (scripts/setup-system.sh installs it). Everything binds to 127.0.0.1; every
process started here is stopped by its PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from types import TracebackType

import click
import msgspec
import redis.asyncio as aioredis

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.celery_app import TASK_NAME, configure  # noqa: E402
from benchmarks.children import child, until  # noqa: E402
from plane.client import Client  # noqa: E402
from plane.contract.backoff import RetryPolicy  # noqa: E402
from plane.contract.config import ConnectOptions  # noqa: E402
from plane.contract.embedded import EmbeddedNats  # noqa: E402
from plane.contract.processes import free_port  # noqa: E402
from plane.pulse import Attempts, LoadConfig, NatsTarget, Target, default_body, pulse  # noqa: E402
from plane.pulse.outcome import ERROR, TIMEOUT  # noqa: E402
from plane.pulse.summary import Summary  # noqa: E402

BIN = Path(sys.executable).parent
_meta = msgspec.json.Decoder(dict[str, object])


# -- the Celery adapter: a pulse target ------------------------------------------------------
class CeleryTarget:
    """Sends `calibrated` tasks with Celery's own client (`send_task`, in one thread so the
    event loop never blocks on it) and learns of results from the Redis result backend's
    pub/sub channel (`celery-task-meta-<id>`), so thousands can wait at once."""

    def __init__(self, broker_url: str, backend_url: str, *, timeout_s: float) -> None:
        self.name = "celery+redis"
        self._app = configure(broker_url, backend_url)
        self._backend_url, self._timeout_s = backend_url, timeout_s
        self._waiting: dict[str, asyncio.Future[str]] = {}
        self._redis: aioredis.Redis | None = None
        self._listener: asyncio.Task[None] | None = None
        self._sender: ThreadPoolExecutor | None = None  # one thread for send_task

    async def __aenter__(self) -> CeleryTarget:
        """Subscribe to results (again, after an exit: one target serves several runs)."""
        self._sender = ThreadPoolExecutor(max_workers=1, thread_name_prefix="celery-send")
        self._redis = aioredis.from_url(self._backend_url)
        pubsub = self._redis.pubsub()
        await pubsub.psubscribe("celery-task-meta-*")
        self._listener = asyncio.create_task(self._listen(pubsub))
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        if self._listener is not None:
            self._listener.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._listener
        if self._redis is not None:
            await self._redis.aclose()
        if self._sender is not None:
            self._sender.shutdown(wait=True)

    async def _listen(self, pubsub: aioredis.client.PubSub) -> None:
        try:
            async for msg in pubsub.listen():
                if msg.get("type") != "pmessage":
                    continue
                meta = _meta.decode(msg["data"])
                fut = self._waiting.get(str(meta.get("task_id")))
                status = str(meta.get("status"))
                if fut is not None and not fut.done() and status in ("SUCCESS", "FAILURE"):
                    fut.set_result("200" if status == "SUCCESS" else "500")
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call,unused-ignore]  # typed since redis 8.2

    async def ready(self) -> bool:
        """A worker answers a 1 µs task within 2 s."""
        warm = default_body("calibrated", duration_us=1)
        return (await self._roundtrip(warm, 2.0)).final == "200"

    async def send(self, body: bytes) -> Attempts:
        return await self._roundtrip(body, self._timeout_s)

    async def _roundtrip(self, body: bytes, timeout_s: float) -> Attempts:
        duration_us = int(json.loads(body)["duration_us"])
        task_id = uuid.uuid4().hex
        fut: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiting[task_id] = fut
        sent = time.monotonic()
        try:
            await asyncio.get_running_loop().run_in_executor(
                self._sender, lambda: self._app.send_task(TASK_NAME, args=[duration_us],
                                                          task_id=task_id))
            async with asyncio.timeout(timeout_s):
                final = await fut
        except TimeoutError:
            final = TIMEOUT
        except Exception:  # a broken broker connection is an answer to count
            final = ERROR
        finally:
            self._waiting.pop(task_id, None)
        code = int(final) if final.isdigit() else 0
        return Attempts(statuses=(code,), final=final,
                        last_attempt_us=int((time.monotonic() - sent) * 1e6))


# -- systems ------------------------------------------------------------------------------
@contextlib.asynccontextmanager
async def celery_system(slots: int, logs: Path, timeout_s: float) -> AsyncIterator[Target]:
    redis_bin = shutil.which("redis-server")
    if redis_bin is None:
        raise click.ClickException("redis-server not found: run scripts/setup-system.sh")
    port = free_port()
    url = f"redis://127.0.0.1:{port}"
    rlog = logs / "redis.log"
    async with child([redis_bin, "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                      "--appendonly", "no", "--protected-mode", "yes"], rlog):
        client = aioredis.from_url(url)

        async def pong() -> bool:
            try:
                return bool(await client.ping())
            except (aioredis.ConnectionError, OSError):
                return False

        await until("redis-server", pong, 10, rlog)
        await client.aclose()
        wlog = logs / "celery-worker.log"
        async with child([str(BIN / "celery"), "-b", f"{url}/0", "--result-backend", f"{url}/1",
                          "-A", "benchmarks.celery_app", "worker", "--pool", "prefork",
                          "--concurrency", str(slots), "--prefetch-multiplier", "1",
                          "--without-gossip", "--without-mingle", "--without-heartbeat",
                          "--loglevel", "WARNING"], wlog):
            target = CeleryTarget(f"{url}/0", f"{url}/1", timeout_s=timeout_s)
            async with target:
                await until("celery worker", target.ready, 60, wlog)
            yield target


@contextlib.asynccontextmanager
async def plane_system(slots: int, logs: Path, deadline_ms: int) -> AsyncIterator[Target]:
    async with EmbeddedNats() as nats_server:
        ulog = logs / "plane-up.log"
        async with child([str(BIN / "plane"), "up", "--nats", nats_server.url, "--models",
                          "calibrated", "--slots", str(slots), "--log-level", "warning"], ulog):
            async with Client.connect(nats_server.url) as probe:

                async def answers() -> bool:
                    r = await probe.call("calibrated", {"duration_us": 1}, deadline_ms=500)
                    return r.ok

                await until("plane up", answers, 60, ulog)
            yield NatsTarget(ConnectOptions(url=nats_server.url, name="bench"),
                             model="calibrated", deadline_ms=deadline_ms,
                             policy=RetryPolicy(max_attempts=4))


# -- measurement ---------------------------------------------------------------------------
async def closed_loop_capacity(target: Target, body: bytes, callers: int, seconds: float) -> float:
    """Answers per second with `callers` callers each waiting for its answer (no overload)."""
    ok = 0
    stop_at = time.monotonic() + seconds

    async def caller() -> None:
        nonlocal ok
        while time.monotonic() < stop_at:
            answer = await target.send(body)  # (not `ok += await ...`: that loses updates)
            ok += answer.final == "200"

    async with asyncio.TaskGroup() as tg:
        for _ in range(callers):
            tg.create_task(caller())
    return ok / seconds


@dataclass(frozen=True)
class Row:
    system: str
    load: float
    rate: float
    p50_ms: float | None
    p99_ms: float | None
    p99_over_p50: float | None
    e2e_p99_ms: float | None
    p99_first_window_ms: float | None
    p99_last_window_ms: float | None
    within_deadline: float | None
    ok_per_s: float
    refusal_rate: float | None
    retry_after_share: float | None
    first_retry_success: float | None
    mean_retries: float | None
    dropped: int
    verdict: str


def row(system: str, load: float, s: Summary) -> Row:
    return Row(system, load, s.rate, s.p50_ms, s.p99_ms, s.p99_over_p50, s.e2e_p99_ms,
               s.p99_by_window_ms[0], s.p99_by_window_ms[-1], s.within_deadline_share,
               s.ok_per_s, s.refusal_rate, s.retry_after_share, s.first_retry_success,
               s.mean_retries, s.dropped, s.verdict)


async def measure(name: str, system: contextlib.AbstractAsyncContextManager[Target],
                  cfg: BenchConfig) -> tuple[float, list[Row]]:
    body = default_body("calibrated", duration_us=cfg.duration_us)
    rows = []
    async with system as target:
        async with target:
            capacity = await closed_loop_capacity(target, body, cfg.slots, cfg.capacity_s)
        click.echo(f"{name}: measured capacity {capacity:.1f}/s", err=True)
        for load in cfg.loads:
            rate = round(load * capacity, 1)
            report = await pulse(target, body, LoadConfig(rate=rate, duration_s=cfg.duration_s,
                                                          concurrency=cfg.concurrency),
                                 deadline_ms=cfg.deadline_ms)
            rows.append(row(name, load, report.summary))
            click.echo(f"{name} {load}x ({rate}/s): {json.dumps(asdict(rows[-1]))}", err=True)
    return capacity, rows


# -- report --------------------------------------------------------------------------------
def _f(v: float | None, pct: bool = False) -> str:
    if v is None:
        return "-"
    return f"{100 * v:.1f}%" if pct else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def markdown(cfg: BenchConfig, capacities: dict[str, float], rows: list[Row],
             command: str) -> str:
    head = ("| system | load | rate/s | p50 ms | p99 ms | p99/p50 | p99 first→last window ms "
            "| e2e p99 ms | within deadline | goodput/s | refused (1st try) | 429s w/ Retry-After "
            "| first-retry success | mean retries | pulse verdict |\n" + "|---" * 15 + "|\n")
    lines = [
        f"| {r.system} | {r.load}x | {r.rate:g} | {_f(r.p50_ms)} | {_f(r.p99_ms)} | "
        f"{_f(r.p99_over_p50)} | {_f(r.p99_first_window_ms)} → {_f(r.p99_last_window_ms)} | "
        f"{_f(r.e2e_p99_ms)} | {_f(r.within_deadline, True)} | "
        f"{_f((r.within_deadline or 0.0) * r.rate)} | "
        + (f"{_f(r.refusal_rate, True)} | {_f(r.retry_after_share, True)} | "
           f"{_f(r.first_retry_success, True)} | {_f(r.mean_retries)} |"
           if r.system == "plane" else "- | - | - | - |") + f" {r.verdict} |"
        for r in rows
    ]
    caps = ", ".join(f"{k} {v:.1f}/s" for k, v in capacities.items())
    return (
        f"Command: `{command}`\n\n"
        f"Compute per task: `calibrated`, {cfg.duration_us} µs; {cfg.slots} plane slots = "
        f"{cfg.slots} Celery prefork worker processes (prefetch 1); deadline "
        f"{cfg.deadline_ms} ms; {cfg.duration_s:g} s per load; measured capacity (closed loop, "
        f"one caller per slot): {caps}. Loads are multiples of each system's own capacity.\n\n"
        + head + "\n".join(lines) + "\n"
    )


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    slots: int = 4
    duration_us: int = 40_000
    duration_s: float = 60.0
    loads: tuple[float, ...] = (0.5, 0.9, 1.5)
    deadline_ms: int = 1000
    capacity_s: float = 5.0
    celery_timeout_s: float = 300.0
    concurrency: int = 20_000


async def bench(cfg: BenchConfig, logs: Path) -> tuple[dict[str, float], list[Row]]:
    capacities: dict[str, float] = {}
    rows: list[Row] = []
    for name, system in (
        ("plane", plane_system(cfg.slots, logs, cfg.deadline_ms)),
        ("celery", celery_system(cfg.slots, logs, cfg.celery_timeout_s)),
    ):
        capacities[name], more = await measure(name, system, cfg)
        rows += more
    return capacities, rows


@click.command()
@click.option("--duration", "duration_s", type=float, default=60.0, show_default=True,
              help="Seconds per offered load.")
@click.option("--slots", type=int, default=4, show_default=True,
              help="Plane slots = Celery worker processes.")
@click.option("--duration-us", type=int, default=40_000, show_default=True,
              help="Compute per task (calibrated).")
@click.option("--deadline-ms", type=int, default=1000, show_default=True)
@click.option("--capacity-s", type=float, default=5.0, show_default=True,
              help="Seconds of closed-loop capacity measurement.")
@click.option("--loads", default="0.5,0.9,1.5", show_default=True)
@click.option("--md", "md_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="Write the table (markdown) here.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="Write every row as JSON here.")
def main(duration_s: float, slots: int, duration_us: int, deadline_ms: int, capacity_s: float,
         loads: str, md_path: Path | None, json_path: Path | None) -> None:
    """The plane against Celery 5 + Redis: same compute, same open-loop load."""
    cfg = BenchConfig(slots=slots, duration_us=duration_us, duration_s=duration_s,
                      loads=tuple(float(x) for x in loads.split(",")),
                      deadline_ms=deadline_ms, capacity_s=capacity_s)
    with tempfile.TemporaryDirectory(prefix="plane-celery-") as tmp:
        try:
            capacities, rows = asyncio.run(bench(cfg, Path(tmp)))
        except RuntimeError as exc:
            raise click.ClickException(str(exc)) from None
    command = "python benchmarks/celery_side_by_side.py " + " ".join(sys.argv[1:])
    text = markdown(cfg, capacities, rows, command)
    click.echo(text)
    if md_path is not None:
        md_path.write_text(text)
    if json_path is not None:
        json_path.write_text(json.dumps({"capacities": capacities,
                                         "rows": [asdict(r) for r in rows]}, indent=1))


if __name__ == "__main__":
    main()
