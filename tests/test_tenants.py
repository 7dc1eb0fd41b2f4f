"""Tenants as NATS accounts, on a real nats-server: the router knows each request's tenant
from the server (`Nats-Request-Info` on a shared service import), shares contended slot time
fairly between tenants, and meters what each used."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client

from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats, NatsServerSpec
from plane.contract.subjects import Header
from plane.stack import PlaneStack, StackConfig
from tests.plane_fixtures import NAMES, calibrated, status, wait_until

pytestmark = pytest.mark.slow

ACCOUNTS = """
accounts {
  PLANE {
    jetstream: enabled
    users: [{user: plane, password: plane-secret}]
    exports: [{service: "plane.infer.>"}]
  }
  HEAVY {
    users: [{user: heavy, password: heavy-secret}]
    imports: [{service: {account: PLANE, subject: "plane.infer.>"}, share: true}]
  }
  LIGHT {
    users: [{user: light, password: light-secret}]
    imports: [{service: {account: PLANE, subject: "plane.infer.>"}, share: true}]
  }
}
"""


def _user_url(url: str, user: str) -> str:
    return url.replace("nats://", f"nats://{user}:{user}-secret@")


async def _caller(nc: Client, until_s: float, pause_s: float, log: list[Call],
                  service_us: list[int]) -> None:
    """Closed loop with retries as the plane asks: after a 429, wait its Retry-After-Ms and
    come back (with the ticket when there is one)."""
    body = calibrated(20_000)
    while time.monotonic() < until_s:
        headers = {Header.DEADLINE_MS: "1000"}
        call = Call()
        while True:
            m = await nc.request(NAMES.infer("calibrated"), body, timeout=5, headers=headers)
            h = m.headers or {}
            call.statuses.append(status(m))
            call.reasons.append(h.get(Header.REASON, ""))
            call.ticketed.append(Header.TICKET in h)
            if status(m) != 429 or time.monotonic() >= until_s:
                break
            await asyncio.sleep(int(h.get(Header.RETRY_AFTER_MS, "1")) / 1000)
            headers = {Header.DEADLINE_MS: "1000"}
            if Header.TICKET in h:
                headers[Header.TICKET] = h[Header.TICKET]
        log.append(call)
        if status(m) == 200:
            service_us.append(int((m.headers or {})[Header.SERVICE_US]))
        await asyncio.sleep(pause_s)


@dataclass
class Call:
    statuses: list[int] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)
    ticketed: list[bool] = field(default_factory=list)

    def first_or_ticketed(self) -> bool:
        """Placed at once, or on the retry its first refusal's ticket asked for."""
        return self.statuses[:1] == [200] or (
            self.statuses[:2] == [429, 200] and self.ticketed[0])


@contextlib.asynccontextmanager
async def accounts_plane(tmp_path: Path, slots: int) -> AsyncIterator[tuple[str, PlaneStack]]:
    """A nats-server with the accounts above and a plane in PLANE: (its URL, the plane)."""
    conf = tmp_path / "accounts.conf"
    conf.write_text(ACCOUNTS)
    async with EmbeddedNats(NatsServerSpec(extra_args=["-c", str(conf)])) as srv:
        cfg = StackConfig(connect=ConnectOptions(url=srv.url, user="plane",
                                                 password="plane-secret"),
                          models=("calibrated",), slots=slots, backend="torch")
        async with PlaneStack(cfg) as stack:
            yield srv.url, stack


async def test_a_heavy_tenant_is_refused_first_and_a_light_one_keeps_its_share(
        tmp_path: Path) -> None:
    async with accounts_plane(tmp_path, slots=2) as (url, stack):
        heavy = await nats.connect(_user_url(url, "heavy"))
        light = await nats.connect(_user_url(url, "light"))
        try:
            logs: dict[str, list[Call]] = {"HEAVY": [], "LIGHT": []}
            used: list[int] = []
            until = time.monotonic() + 6
            # HEAVY: 6 callers back to back (3x the 2 slots); LIGHT: one caller with a
            # pause, about a third of one slot.
            await asyncio.gather(
                *(_caller(heavy, until, 0.0, logs["HEAVY"], used) for _ in range(6)),
                _caller(light, until, 0.04, logs["LIGHT"], used))
            heavy_reasons = Counter(r for c in logs["HEAVY"] for r in c.reasons)
            light_reasons = Counter(r for c in logs["LIGHT"] for r in c.reasons)
            assert heavy_reasons["tenant-share"] > 0, heavy_reasons
            assert light_reasons["tenant-share"] == 0, light_reasons
            # The light tenant is placed at once or on its ticket's retry (the benchmark
            # holds it to 99%; here a loaded 2-core box runs the servers too).
            light_ok = sum(c.first_or_ticketed() for c in logs["LIGHT"])
            assert light_ok >= 0.95 * len(logs["LIGHT"]), (light_ok, len(logs["LIGHT"]),
                                                            light_reasons)

            # Metering: per tenant, the router's meter agrees with what callers got.
            router = stack.routers[0]
            await asyncio.sleep(0.3)  # the last done-events
            # Asked over the node's connection (the plane's account): a router's own has no
            # echo and does not reach its own endpoints (`router_connection`).
            plane_nc = stack.nodes[0].nc
            reply = await plane_nc.request(NAMES.router_meter(router.cfg.router_id), b"",
                                           timeout=2)
            meter = json.loads(reply.data)["meter"]
            by_tenant = {row["tenant"]: row for row in meter}
            assert set(by_tenant) == {"HEAVY", "LIGHT"}, meter
            assert by_tenant["HEAVY"]["requests"]["429"] > 0
            metered_us = sum(row["slot_us"] for row in meter)
            assert metered_us == pytest.approx(sum(used), rel=0.01)
            assert by_tenant["LIGHT"]["sm_ms"] == pytest.approx(
                by_tenant["LIGHT"]["slot_us"] / 1000, rel=0.01)  # off a GPU: x1
            # The plane_tenant_* counters are the same record, as Prometheus reads it.
            scraped = router.metrics.registry.get_sample_value
            for row in meter:
                who = {"tenant": row["tenant"], "model": row["model"]}
                for status, n in row["requests"].items():
                    assert scraped("plane_tenant_requests_total", {**who, "status": status}) == n
                assert scraped("plane_tenant_slot_seconds_total", who) == pytest.approx(
                    row["slot_us"] / 1e6)
                assert scraped("plane_tenant_sm_seconds_total", who) == pytest.approx(
                    row["sm_ms"] / 1000, rel=1e-3)
        finally:
            await heavy.close()
            await light.close()


async def test_a_tenant_limit_set_live_applies_and_lifts() -> None:
    """`max_rate.<tenant>` put in PLANE_CONFIG while the plane runs: the router refuses past
    it (429 `tenant-limit`); deleted, nothing is refused for it any more."""
    from tests.plane_fixtures import plane, wait_until

    async with plane(models=("calibrated",), slots=2, backend="torch") as stack:
        nc = await nats.connect(stack.url)
        try:
            kv = await nc.jetstream().key_value(NAMES.config_bucket)
            router = stack.routers[0]
            await kv.put("max_rate.default", b"1")
            await wait_until(lambda: router.requests._limits_set, 5.0, "the limit seen")
            # A deadline that a token a second away still meets: refused `tenant-limit`
            # with a ticket (a booked token), not `deadline`.
            answers = [await nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5,
                                        headers={Header.DEADLINE_MS: "5000"})
                       for _ in range(4)]
            reasons = [(status(m), (m.headers or {}).get(Header.REASON)) for m in answers]
            assert reasons[0][0] == 200 and (429, "tenant-limit") in reasons, reasons
            await kv.delete("max_rate.default")
            await wait_until(lambda: not router.requests._limits_set, 5.0, "the limit gone")
            for _ in range(4):
                m = await nc.request(NAMES.infer("calibrated"), calibrated(0), timeout=5)
                assert status(m) == 200
        finally:
            await nc.close()


async def test_a_tenant_limit_refusal_is_worth_its_retry_after() -> None:
    """A caller refused `tenant-limit` that comes back at its Retry-After (with the ticket it
    was given) is let through, while its tenant keeps sending: the refusal booked it the
    bucket's next token, which the tenant's newcomers cannot take. (Before, the Retry-After
    was an estimate and the newcomers, 200/s here against 10/s, took the token first: the
    retry was refused `tenant-limit` again; found from outside, probe F.)"""
    from tests.plane_fixtures import plane

    async with plane(models=("calibrated",), slots=2, backend="torch") as stack:
        flood, holder = await nats.connect(stack.url), await nats.connect(stack.url)
        subject = NAMES.infer("calibrated")
        stop = asyncio.Event()
        sending: asyncio.Future[list[None]] | None = None

        async def newcomers() -> None:  # the tenant's other caller: never retries
            while not stop.is_set():
                with contextlib.suppress(nats.errors.TimeoutError):
                    await flood.request(subject, calibrated(0), timeout=5,
                                        headers={Header.DEADLINE_MS: "2000"})
                await asyncio.sleep(0.005)

        try:
            kv = await holder.jetstream().key_value(NAMES.config_bucket)
            router = stack.routers[0]
            await kv.put("max_rate.default", b"10")
            await wait_until(lambda: router.requests._limits_set, 5.0, "the limit seen")
            sending = asyncio.gather(newcomers(), newcomers())
            await asyncio.sleep(1.5)  # the newcomers' own tickets lapse unused meanwhile
            retries: list[tuple[int, str | None, str | None]] = []
            for i in range(80):
                if len(retries) == 8:
                    break
                rid = f"holder-{i}"
                m = await holder.request(subject, calibrated(0), timeout=5, headers={
                    Header.DEADLINE_MS: "2000", Header.REQUEST_ID: rid})
                h = m.headers or {}
                if status(m) != 429 or h.get(Header.REASON) != "tenant-limit":
                    continue
                await asyncio.sleep(int(h[Header.RETRY_AFTER_MS]) / 1000)
                again = {Header.DEADLINE_MS: "2000", Header.REQUEST_ID: rid,
                         Header.ATTEMPT: "2"}
                if ticket := h.get(Header.TICKET):
                    again[Header.TICKET] = ticket
                m = await holder.request(subject, calibrated(0), timeout=5, headers=again)
                retries.append((status(m), (m.headers or {}).get(Header.REASON),
                                h.get(Header.TICKET)))
            assert len(retries) == 8, retries
            assert all(s == 200 for s, _, _ in retries), retries
        finally:
            stop.set()
            if sending is not None:
                await sending
            await flood.close()
            await holder.close()


async def test_a_caller_across_an_import_is_not_put_on_call(tmp_path: Path) -> None:
    """`Plane-Wake` names an inbox in the caller's own account, which the router cannot
    reach across a service import: such a caller is told the usual Retry-After, not one
    that counts on a call. The same request from inside the plane's account is on call."""
    async with accounts_plane(tmp_path, slots=1) as (url, stack):
        heavy = await nats.connect(_user_url(url, "heavy"))
        light = await nats.connect(_user_url(url, "light"))
        inside = await nats.connect(_user_url(url, "plane"))
        try:
            subject = NAMES.infer("calibrated")
            running = asyncio.create_task(light.request(
                subject, calibrated(400_000), timeout=5,
                headers={Header.DEADLINE_MS: "2000"}))
            await asyncio.sleep(0.1)  # it runs on the only slot
            messages = {}
            for who, nc in (("import", heavy), ("inside", inside)):
                m = await nc.request(subject, calibrated(300_000), timeout=5, headers={
                    Header.DEADLINE_MS: "5000", Header.WAKE: nc.new_inbox()})
                assert status(m) == 429, (who, m.headers)
                messages[who] = json.loads(m.data)["error"]
            assert "or when called" not in messages["import"], messages
            assert "or when called" in messages["inside"], messages
            assert status(await running) == 200
            assert stack.routers[0].admission.stats["ticket-valid"] == 0
        finally:
            for nc in (heavy, light, inside):
                await nc.close()


@pytest.mark.parametrize("forged", [
    {Header.TICKET: "r-0123456789ab.42"},  # not even a ticket's shape
    {Header.TICKET: "router0-0123456789abcdef"},  # the shape, as of this plane's router
    {Header.TICKET: "ghost-0123456789abcdef"},  # as of a router that does not exist
    {Header.FORWARDED_BY: "some-router"},  # a forward's mark, on the public subject
    {Header.FORWARDED_BY: "some-router", Header.REPLY_TO: "_INBOX.elsewhere"},
])
async def test_a_tenant_cannot_pass_its_limit_with_forged_router_headers(
        tmp_path: Path, forged: dict[str, str]) -> None:
    """A tenant's limit holds against a caller that sends what only the plane sends: a
    ticket no router issued, or the mark of a forward between routers (which comes on a
    router's own subject, never on `plane.infer.<model>`). Such a request is judged as the
    newcomer it is: past the tenant's `max_rate`, refused `tenant-limit`."""
    async with accounts_plane(tmp_path, slots=2) as (url, stack):
        inside = await nats.connect(_user_url(url, "plane"))
        heavy = await nats.connect(_user_url(url, "heavy"))
        try:
            kv = await inside.jetstream().key_value(NAMES.config_bucket)
            router = stack.routers[0]
            await kv.put("max_rate.HEAVY", b"1")
            await wait_until(lambda: router.requests._limits_set, 5.0, "the limit seen")
            answers = [await heavy.request(NAMES.infer("calibrated"), calibrated(0), timeout=5,
                                           headers={**forged, Header.DEADLINE_MS: "5000"})
                       for _ in range(4)]
            reasons = [(status(m), (m.headers or {}).get(Header.REASON)) for m in answers]
            assert (429, "tenant-limit") in reasons, reasons
            assert all(s in (200, 429) for s, _ in reasons), reasons
        finally:
            await heavy.close()
            await inside.close()
