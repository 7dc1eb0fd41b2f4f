"""Hostile and careless input on real servers (issue 16): caller headers the plane cannot
carry, lenient numbers, live settings out of range, slow HTTP clients, and a process whose
stderr nobody reads. Each is refused or contained at its cause, and the plane keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from nats.aio.client import Client
from nats.aio.msg import Msg
from structlog.testing import capture_logs

from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats
from plane.contract.errors import BadRequest
from plane.contract.headers import MAX_HEADER_BYTES, read_caller
from plane.contract.logs import LineSink
from plane.contract.natsconn import Throttle
from plane.contract.publish import publish
from plane.contract.subjects import Header, config_key
from plane.gateway import Gateway, GatewayConfig
from plane.gateway.server import LINGERING_S
from plane.stack import PlaneStack
from tests.plane_fixtures import NAMES, calibrated, client, header, plane, status, wait_until

PLANE = str(Path(sys.executable).parent / "plane")
NODE = "node0-calibrated"
FRESH_ID = re.compile(r"[\x21-\x7e]{1,128}")
SERVER_MAX_PAYLOAD = 1024 * 1024  # nats-server's default


def assert_fresh_id(reply_id: str | None, sent: str) -> None:
    assert reply_id is not None and reply_id != sent and FRESH_ID.fullmatch(reply_id), reply_id


# -- 1. metadata validated before anything is echoed or published -------------------------------
@pytest.fixture
async def stack() -> AsyncIterator[PlaneStack]:
    async with plane(models=("calibrated",), slots=2) as s:
        yield s


async def ask(nc: Client, headers: dict[str, str], body: bytes | None = None) -> Msg:
    return await nc.request(NAMES.infer("calibrated"), body or calibrated(100), timeout=5,
                            headers=headers)


async def test_router_answers_a_bad_request_id_400_with_a_fresh_id_and_keeps_its_connection(
    stack: PlaneStack,
) -> None:
    router_nc = stack.routers[0].nc
    body = calibrated(100)
    # A request that just fits under the server's limit: any echo of its id would not.
    wire = len(b"NATS/1.0\r\n") + len(f"{Header.REQUEST_ID}: \r\n\r\n") + len(body)
    huge = "x" * (SERVER_MAX_PAYLOAD - wire - 64)
    async with client(stack.url) as nc:
        for rid in ("y" * 100_000, huge, "has space", "caf\u00e9", "tab\there"):
            m = await ask(nc, {Header.REQUEST_ID: rid}, body)
            assert status(m) == 400, (len(rid), m.headers, m.data[:200])
            assert header(m, Header.REASON) == "bad-request"
            assert_fresh_id(header(m, Header.REQUEST_ID), rid)
            assert len(m.data) < 1024  # the error names the header, never echoes the value
            assert Header.REQUEST_ID in json.loads(m.data)["error"]
        m = await ask(nc, {Header.REQUEST_ID: "ok-1"})
        assert status(m) == 200 and header(m, Header.REQUEST_ID) == "ok-1"
    assert router_nc.is_connected and router_nc.stats["reconnects"] == 0


BAD_HEADERS: list[dict[str, str]] = [
    *({Header.DEADLINE_MS: v} for v in (
        "+50", "5_0", "\u0665\u0660", "\u00b2", "5" * 5000, "0", "-5", "50.0", "1e3",
        "600001", "0x32")),
    *({Header.ATTEMPT: v} for v in ("x", "0", "\u00b2", "+1", "1" * 50)),
    {Header.TICKET: "t" * 200},
    {Header.TICKET: "a ticket"},
    {Header.AVOID_NODE: "bad.node"},
    {Header.AVOID_NODE: "n" * 65},
    {Header.CONTENT_TYPE: "a" * 200},
    # A tenant name the plane cannot keep was counted as tenant `other`, silently.
    {Header.TENANT: "a b"}, {Header.TENANT: "t" * 65}, {Header.TENANT: "t.x"},
    *({Header.WAIT_MS: v} for v in ("0", "-1", "+5", "5.0", "600001", "\u00b2", "1" * 50)),
    # The router publishes to a wake inbox: never a wildcard, never a subject outside the
    # callers' inboxes (a slot's would put an empty message on the slot).
    *({Header.WAKE: v} for v in (
        "plane.slot.calibrated.n.0", "_INBOX.*", "_INBOX.>", "_INBOX", "_INBOX.", "_INBOX..a",
        "_INBOX.a b", "_INBOX.a.", "_INBOX." + "a" * 200, "x_INBOX.a")),
    {f"X-Pad-{i}": "p" * 300 for i in range(MAX_HEADER_BYTES // 300 + 1)},
]


def test_headers_are_measured_in_utf8_bytes() -> None:
    """Under the limit in characters, over it in UTF-8 bytes (what the wire carries)."""
    fits = {"X-Pad": "\u00e9" * (MAX_HEADER_BYTES // 2 - 20)}
    assert read_caller(fits).request_id is None
    with pytest.raises(BadRequest, match="bytes; the limit is"):
        read_caller({"X-Pad": "\u00e9" * (MAX_HEADER_BYTES // 2)})


async def test_router_refuses_every_bad_caller_header_400_and_echoes_the_valid_id(
    stack: PlaneStack,
) -> None:
    async with client(stack.url) as nc:
        wrong = []
        for bad in BAD_HEADERS:
            m = await ask(nc, {Header.REQUEST_ID: "rid-1", **bad})
            if not (status(m) == 400 and header(m, Header.REASON) == "bad-request"
                    and header(m, Header.REQUEST_ID) == "rid-1" and len(m.data) < 1024):
                wrong.append((bad if len(str(bad)) < 80 else str(bad)[:80], status(m)))
        assert not wrong, wrong
        m = await ask(nc, {Header.DEADLINE_MS: "600000", Header.ATTEMPT: "2",
                           Header.AVOID_NODE: "node9", Header.TICKET: "r-x-00000000",
                           Header.WAKE: "_INBOX.Ab-1_z.2", Header.WAIT_MS: "600000"})
        assert status(m) == 200
    assert stack.routers[0].nc.stats["reconnects"] == 0


async def test_router_refuses_a_plane_header_given_twice_400_naming_it(
    stack: PlaneStack,
) -> None:
    """NATS allows a header name twice (nats.go's `Header.Add`, nats.js's `append`); nats-py
    kept the last value, so `Plane-Deadline-Ms: 5` then `: 9000` ran as 9000, silently."""
    async with client(stack.url) as nc:
        inbox = nc.new_inbox()
        answers: asyncio.Queue[Msg] = asyncio.Queue()
        await nc.subscribe(inbox, cb=answers.put)

        async def raw(block: bytes) -> Msg:
            await publish(nc, NAMES.infer("calibrated"), calibrated(100), block, reply=inbox)
            return await asyncio.wait_for(answers.get(), 5)

        m = await raw(b"NATS/1.0\r\nPlane-Request-Id: dup-1\r\nPlane-Deadline-Ms: 5\r\n"
                      b"Plane-Deadline-Ms: 9000\r\n\r\n")
        assert status(m) == 400 and header(m, Header.REASON) == "bad-request", m.headers
        assert header(m, Header.REQUEST_ID) == "dup-1"
        assert "Plane-Deadline-Ms given more than once" in json.loads(m.data)["error"]
        m = await raw(b"NATS/1.0\r\nPlane-Request-Id: dup-2\r\nPlane-Request-Id: dup-3\r\n\r\n")
        assert status(m) == 400
        assert_fresh_id(header(m, Header.REQUEST_ID), "dup-3")  # neither is echoed
        # Repeated headers that are not the plane's are the caller's business.
        m = await raw(b"NATS/1.0\r\nPlane-Request-Id: dup-4\r\nX-Tag: a\r\nX-Tag: b\r\n\r\n")
        assert status(m) == 200 and header(m, Header.REQUEST_ID) == "dup-4"


@pytest.fixture
async def gateway(stack: PlaneStack) -> AsyncIterator[Gateway]:
    async with Gateway(GatewayConfig(port=0), ConnectOptions(url=stack.url)) as gw:
        yield gw


@pytest.fixture
async def impatient_gateway(stack: PlaneStack) -> AsyncIterator[Gateway]:
    cfg = GatewayConfig(port=0, header_timeout_s=1.0, body_timeout_s=1.0)
    async with Gateway(cfg, ConnectOptions(url=stack.url)) as gw:
        yield gw


async def test_gateway_answers_bad_headers_400_never_500(gateway: Gateway) -> None:
    url = f"{gateway.url}/v1/infer/calibrated"
    async with aiohttp.ClientSession() as http:
        wrong = []
        # One header over aiohttp's 8190-byte line: its parser answered a text/plain 400.
        for bad in [*BAD_HEADERS, {Header.REQUEST_ID: "i" * 200},
                    {Header.REQUEST_ID: "has space"}, {"X-Big": "b" * 9000}]:
            async with http.post(url, json={"duration_us": 100}, headers=bad) as r:
                body = await r.read()
                rid = r.headers.get(Header.REQUEST_ID)
                sent = bad.get(Header.REQUEST_ID)
                ok_id = (rid is not None and FRESH_ID.fullmatch(rid) is not None
                         and rid != sent)
                if not (r.status == 400 and r.headers.get(Header.REASON) == "bad-request"
                        and ok_id and len(body) < 1024 and "error" in json.loads(body)):
                    wrong.append((str(bad)[:60], r.status, rid and rid[:20]))
        assert not wrong, wrong
        # A model name with a trailing newline passed the token check (a regex `$`).
        async with http.post(f"{url}%0A", json={"duration_us": 100}) as r:
            assert r.status == 400 and r.headers[Header.REASON] == "bad-request"
        async with http.post(url, json={"duration_us": 100},
                             headers={Header.REQUEST_ID: "g-1", Header.ATTEMPT: "3"}) as r:
            assert r.status == 200 and r.headers[Header.REQUEST_ID] == "g-1"
    # A Plane- header twice (HTTP names are case-insensitive): a 400 naming it. Sent raw:
    # aiohttp's client keeps one of a name.
    body = b'{"duration_us": 100}'
    assert gateway.port is not None
    reader, writer = await asyncio.open_connection("127.0.0.1", gateway.port)
    writer.write(b"POST /v1/infer/calibrated HTTP/1.1\r\nHost: x\r\nConnection: close\r\n"
                 b"Plane-Request-Id: g-2\r\nplane-deadline-ms: 5\r\nPlane-Deadline-Ms: 9000\r\n"
                 b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                 % (len(body), body))
    answer = await asyncio.wait_for(reader.read(), 5)
    writer.close()
    head, _, sent = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"Plane-Request-Id: g-2" in head, head
    assert "Plane-Deadline-Ms given more than once" in json.loads(sent)["error"]


async def closed_within(reader: asyncio.StreamReader, timeout_s: float) -> float:
    """Seconds until the server closes the connection (reads whatever it sends first)."""
    t0 = time.monotonic()
    async with asyncio.timeout(timeout_s):
        with contextlib.suppress(ConnectionResetError):
            while await reader.read(4096):
                pass
    return time.monotonic() - t0


async def test_gateway_closes_slow_heads_slow_bodies_and_idle_connections(
    impatient_gateway: Gateway,
) -> None:
    gateway = impatient_gateway
    assert gateway.port is not None

    async def connect() -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        return await asyncio.open_connection("127.0.0.1", gateway.port)

    # Slowloris: a head trickled a few bytes at a time, never finished.
    reader, writer = await connect()
    writer.write(b"POST /v1/infer/calibrated HTTP/1.1\r\nHost: x\r\n")

    async def trickle() -> None:
        with contextlib.suppress(ConnectionError):
            for i in range(100):
                writer.write(f"X-{i}: y\r\n".encode())
                await writer.drain()
                await asyncio.sleep(0.2)

    dripping = asyncio.create_task(trickle())
    try:
        took = await closed_within(reader, 4.0)
    finally:
        dripping.cancel()
        writer.close()
    assert took < 3.0
    # A body trickled after a whole head: answered 408 and closed, at once (not after
    # aiohttp's lingering read of the rest of the body: 10 s by default, the client still
    # trickling).
    reader, writer = await connect()
    writer.write(b"POST /v1/infer/calibrated HTTP/1.1\r\nHost: x\r\n"
                 b"Content-Length: 100\r\n\r\n{")
    await writer.drain()
    async with asyncio.timeout(4.0):
        answer = await reader.read(4096)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:80]

    async def drip() -> None:
        with contextlib.suppress(ConnectionError):
            for _ in range(30):
                writer.write(b" ")
                await writer.drain()
                await asyncio.sleep(0.2)

    dripping = asyncio.create_task(drip())
    try:
        took = await closed_within(reader, 4.0)
    finally:
        dripping.cancel()
        writer.close()
    assert took < LINGERING_S + 1.0
    # An idle keep-alive connection after a complete request: closed.
    reader, writer = await connect()
    writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
    await writer.drain()
    took = await closed_within(reader, 4.0)
    writer.close()
    assert took < 3.0


# -- 2. live settings validated ------------------------------------------------------------------
async def settle(kv: object, stack: PlaneStack, n: int) -> None:
    """Every watcher has applied what came before: a valid marker value, put last, is seen."""
    await kv.put(config_key("freshness_ms"), str(n).encode())  # type: ignore[attr-defined]
    await wait_until(lambda: all(s.settings.get("freshness_ms") == n
                                 for s in (*stack.routers, *stack.nodes)), 3, "marker")


async def test_live_settings_out_of_range_are_refused_and_the_old_value_kept(
    stack: PlaneStack,
) -> None:
    router, node = stack.routers[0], stack.nodes[0]
    async with client(stack.url) as nc:
        kv = await nc.jetstream().key_value(NAMES.config_bucket)
        deadline = config_key("deadline_ms", "calibrated")
        await kv.put(deadline, b"900")
        await kv.put(config_key("probe_ms"), b"200")
        marker = 100
        await settle(kv, stack, marker)
        with capture_logs() as logs:
            for bad in (b"-5", b"0", b"999999999", b" 50", b"+50", b"5_0",
                        "\u0665\u0660".encode(), b"1e3", b"", b"\xff"):
                await kv.put(deadline, bad)
            for bad in (b"1", b"9", b"60001"):
                await kv.put(config_key("probe_ms"), bad)
            for bad in (b"-1", b"0", b"300", b"100000"):
                await kv.put(config_key("slots", NODE), bad)
            marker += 1
            await settle(kv, stack, marker)
        for s in (router.settings, node.settings):
            assert s.deadline_ms("calibrated") == 900
            assert s.get("probe_ms") == 200
            assert s.get("slots", NODE) is None
        refused = [e for e in logs if e["event"] == "live setting refused"]
        assert len(refused) >= 2 * 17  # router and node each saw every bad value
        assert any(e["key"] == deadline and e["value"] == "'-5'" and e["range"] == "1..600000"
                   for e in refused), refused[:3]
        # The node kept its slots, all healthy; requests are still served.
        assert len(node.slots) == 2 and all(s.claimed and s.healthy for s in node.slots)
        assert router.models["calibrated"].healthy_count() == 2
        m = await nc.request(NAMES.infer("calibrated"), calibrated(100), timeout=5)
        assert status(m) == 200
        # In range for the settings, more than a CPU backend can run: the node keeps its 2.
        with capture_logs() as logs:
            await kv.put(config_key("slots", NODE), b"200")
            marker += 1
            await settle(kv, stack, marker)
            # The node resizes in a task of its own: wait for its word on the 200.
            await wait_until(lambda: any(e["event"] == "live setting refused"
                                         and e.get("key") == f"slots.{NODE}" for e in logs),
                             3, "the node to refuse 200 slots")
        assert len(node.slots) == 2 and node.target_slots == 2
        # A good value still works.
        await kv.put(config_key("slots", NODE), b"3")
        await wait_until(lambda: router.models["calibrated"].healthy_count() == 3, 3, "3 slots")


# -- 4. a log write never blocks the loop; a stop with the server gone is clean ----------------
def test_a_full_log_queue_drops_and_counts_lines_and_never_blocks() -> None:
    written: list[str] = []
    taken, release = threading.Event(), threading.Event()

    def out(text: str) -> None:  # a stderr nobody reads: blocks until released
        taken.set()
        release.wait(10)
        written.append(text)

    sink = LineSink(out, notice=lambda n: f"dropped {n}\n", max_lines=10)
    sink.write("first\n")
    assert taken.wait(5)  # the writer thread holds the first line, blocked
    t0 = time.monotonic()
    for i in range(100):
        sink.write(f"line {i}\n")
    assert time.monotonic() - t0 < 0.5  # never waited for the writer
    assert sink.dropped == 90
    release.set()
    assert sink.wait_written(5)
    sink.write("after\n")
    assert sink.wait_written(5)
    assert written[:2] == ["first\n", "dropped 90\n"]
    assert written[2:12] == [f"line {i}\n" for i in range(10)] and written[-1] == "after\n"


def test_repeated_connection_errors_pass_once_per_period_with_their_count() -> None:
    now = [0.0]
    throttle = Throttle(30.0, clock=lambda: now[0])
    assert throttle.allow("ConnectionRefusedError") == 0
    for _ in range(5):
        now[0] += 0.25
        assert throttle.allow("ConnectionRefusedError") is None
    assert throttle.allow("UnexpectedEOF") == 0  # another kind is its own line
    now[0] = 30.0
    assert throttle.allow("ConnectionRefusedError") == 5
    throttle.reset()  # reconnected: the next outage is reported at once
    assert throttle.allow("ConnectionRefusedError") == 0


async def start_router(url: str, stderr: int) -> asyncio.subprocess.Process:
    proc = await asyncio.create_subprocess_exec(
        PLANE, "router", "--nats", url, "--router-id", "abuse", "--log-level", "info",
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.DEVNULL, stderr=stderr)
    async with client(url) as nc:
        t_end = time.monotonic() + 60
        while True:
            try:
                await nc.request(NAMES.router_status("abuse"), b"", timeout=0.5)
                return proc
            except Exception:
                if time.monotonic() > t_end or proc.returncode is not None:
                    proc.kill()
                    raise
                await asyncio.sleep(0.2)


async def exited_within(proc: asyncio.subprocess.Process, timeout_s: float) -> int | None:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout_s):
            return await proc.wait()
    return None


F_SETPIPE_SZ = 1031


async def test_router_stops_on_sigterm_while_nobody_reads_its_stderr() -> None:
    read_fd, write_fd = os.pipe()
    fcntl.fcntl(write_fd, F_SETPIPE_SZ, 4096)  # the smallest pipe: full in a few lines
    # Our own way in to fill it, non-blocking, without making the router's writes so (the
    # flag belongs to an open file description; this opens a second one).
    filler = os.open(f"/proc/self/fd/{write_fd}", os.O_WRONLY | os.O_NONBLOCK)
    proc = None
    try:
        async with EmbeddedNats() as server:
            proc = await start_router(server.url, write_fd)
            os.close(write_fd)
            write_fd = -1
            with contextlib.suppress(BlockingIOError):
                while True:
                    os.write(filler, b"x" * 256)
            await server.stop(kill=True)  # every reconnect attempt now wants a log line
            await asyncio.sleep(1.5)
            proc.send_signal(signal.SIGTERM)
            rc = await exited_within(proc, 6.0)
            assert rc == 0, f"rc {rc}: a full stderr pipe kept the router from stopping"
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
        for fd in (read_fd, write_fd, filler):
            if fd >= 0:
                os.close(fd)


async def test_router_stops_cleanly_with_its_server_gone_and_logs_reconnects_sparingly() -> None:
    proc = None
    try:
        async with EmbeddedNats() as server:
            proc = await start_router(server.url, asyncio.subprocess.PIPE)
            assert proc.stderr is not None
            lines: list[bytes] = []

            async def read_all() -> None:
                assert proc is not None and proc.stderr is not None
                while line := await proc.stderr.readline():
                    lines.append(line)

            reading = asyncio.create_task(read_all())
            await server.stop(kill=True)
            down_at = len(lines)
            await asyncio.sleep(3.0)  # about 12 reconnect attempts
            errors = [ln for ln in lines[down_at:] if b"nats connection error" in ln]
            proc.send_signal(signal.SIGTERM)
            rc = await exited_within(proc, 6.0)
            async with asyncio.timeout(5):
                await reading
            text = b"".join(lines).decode(errors="replace")
            assert rc == 0, text[-2000:]
            assert "Traceback" not in text and "ConnectionReconnectingError" not in text, text
            assert 1 <= len(errors) <= 2, errors
    finally:
        if proc is not None and proc.returncode is None:
            proc.kill()
            await proc.wait()
