"""Roles and tenants on a real nats-server running `plane auth`'s config.

Each attempt to step outside a role or a tenant must fail with a permission error while the
plane keeps serving. NATS reports a permission violation to the offender only: the server
logs it and sends `-ERR 'Permissions Violation for Publish to ...'`, nats-py hands that to
the connection's `error_cb`, and the server closes nothing (the offender stays connected).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import nats
import pytest
import yaml
from kafka_fixtures import SESSION_TIMEOUT_MS, kafka_topic, produce, tansu, txn_line
from nats.aio.client import Client as Nats
from nats.aio.msg import Msg

from freshness.bridge import KafkaBridge
from freshness.config import BridgeConfig, GuardConfig, UpdaterConfig
from freshness.features import FeatureUpdater
from freshness.guard import CardFeatureGuard
from freshness.tansu import EmbeddedTansu
from plane.auth.live import can_connect, tenant_let_in
from plane.auth.roles import Permissions, role_permissions, tenant
from plane.auth.store import AuthDir
from plane.client import Client
from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats, NatsServerSpec, nats_server_binary
from plane.contract.errors import ConfigError, ConnectionClosed
from plane.contract.messages import DoneEvent, FaultCommand, json_encoder, read_done
from plane.contract.natsconn import connect
from plane.contract.provision import ProvisionPlan, ensure_all, ensure_config_bucket
from plane.contract.subjects import Header, Names
from plane.stack import PlaneStack, StackConfig
from tests.plane_fixtures import wait_until

__all__ = ["kafka_topic", "tansu"]  # fixtures, imported for pytest

NAMES = Names()
NODE = "node0-calibrated"  # the stack's node
SLOT = NAMES.slot("calibrated", NODE, 0)
JS_DIR = Path(__file__).parent / "js"
ROOT = Path(__file__).parent.parent
PLANE = str(Path(sys.executable).parent / "plane")


@pytest.fixture
def auth(tmp_path: Path) -> AuthDir:
    d = AuthDir(tmp_path / "auth", rounds=4)  # the cheapest bcrypt cost: tests connect a lot
    d.init()
    d.add_tenant("acme", share=2, max_rate=500)
    d.add_tenant("beta")
    return d


@dataclass
class Secured:
    server: EmbeddedNats
    stack: PlaneStack
    auth: AuthDir

    @property
    def url(self) -> str:
        return self.server.url

    def violations(self) -> list[str]:
        return [line.decode(errors="replace") for line in self.server.violations]


@asynccontextmanager
async def secured(auth: AuthDir, *, slot_shards: int | None = None,
                  **kw: object) -> AsyncIterator[Secured]:
    """A plane under the roles; `slot_shards`: its slot streams laid out as a cluster's,
    provisioned by admin first (the plane's processes find them by subject)."""
    async with EmbeddedNats(NatsServerSpec(extra_args=auth.server_args())) as server:
        if slot_shards is not None:
            nc = await connect(auth.options("admin", server.url))
            try:
                await ensure_all(nc.jetstream(), ProvisionPlan(names=NAMES,
                                                               slot_shards=slot_shards))
            finally:
                await nc.close()
        kw = {"models": ("calibrated",), "slots": 2, **kw}
        cfg = StackConfig(connect=auth.options("admin", server.url), roles=auth.roles(),
                          settings=auth.tenant_settings(), **kw)  # type: ignore[arg-type]
        async with PlaneStack(cfg) as stack:
            yield Secured(server, stack, auth)


@dataclass
class Offender:
    """A connection that records what the server refused it."""

    nc: Nats
    errors: list[str] = field(default_factory=list)

    async def refused(self, what: str, timeout_s: float = 5.0) -> str:
        """The permission error naming `what` (waits for the server's -ERR)."""
        await self.nc.flush()
        async with asyncio.timeout(timeout_s):
            while True:
                for e in self.errors:  # nats-py lowercases the server's -ERR text
                    if "permissions violation" in e and f'"{what.lower()}"' in e.lower():
                        return e
                await asyncio.sleep(0.02)


@asynccontextmanager
async def offender(opts: ConnectOptions) -> AsyncIterator[Offender]:
    errors: list[str] = []

    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    assert opts.url is not None
    nc = await nats.connect(opts.url, user=opts.user, password=opts.password,
                            name=opts.name, error_cb=on_error, allow_reconnect=False)
    try:
        yield Offender(nc, errors)
    finally:
        await nc.close()


async def still_serving(plane: Secured, tenant: str = "acme") -> None:
    """A tenant's SDK call is answered 200 by the plane."""
    async with Client.connect(plane.auth.options(tenant, plane.url)) as c:
        result = await c.invoke("calibrated", {"duration_us": 1000}, deadline_ms=2000)
    assert result.node == NODE


async def put_config_value(plane: Secured, key: str, value: bytes) -> None:
    nc = await connect(plane.auth.options("admin", plane.url))
    try:
        await (await nc.jetstream().key_value(NAMES.config_bucket)).put(key, value)
    finally:
        await nc.close()


async def config_value(plane: Secured, key: str) -> bytes | None:
    nc = await connect(plane.auth.options("admin", plane.url))
    try:
        kv = await nc.jetstream().key_value(NAMES.config_bucket)
        try:
            return (await kv.get(key)).value
        except nats.js.errors.KeyNotFoundError:
            return None
    finally:
        await nc.close()


# -- the config itself ------------------------------------------------------------------------
def test_init_writes_a_valid_private_config_and_keeps_its_secrets(tmp_path: Path) -> None:
    d = tmp_path / "auth"
    run = [PLANE, "auth"]
    out = subprocess.run([*run, "init", str(d), "--json"], check=True, capture_output=True,
                         text=True, cwd=ROOT).stdout
    roles = json.loads(out)
    assert set(roles) == {"router", "node", "bridge", "gateway", "admin"}
    assert all(set(v) == {"user", "password"} and len(v["password"]) >= 32
               for v in roles.values())
    for name in ("nats.conf", "auth.json"):
        assert stat.S_IMODE((d / name).stat().st_mode) == 0o600
    conf = (d / "nats.conf").read_text()
    assert all(v["password"] not in conf for v in roles.values())  # hashes only
    subprocess.run([nats_server_binary(), "-c", str(d / "nats.conf"), "-t"], check=True,
                   capture_output=True)
    again = json.loads(subprocess.run([*run, "init", str(d), "--json"], check=True,
                                      capture_output=True, text=True, cwd=ROOT).stdout)
    assert again == roles  # a running plane's credentials never change behind its back
    tenant = json.loads(subprocess.run(
        [*run, "add-tenant", str(d), "acme", "--share", "3", "--max-rate", "100", "--json"],
        check=True, capture_output=True, text=True, cwd=ROOT).stdout)
    assert list(tenant) == ["acme"] and tenant["acme"]["user"] == "acme"
    assert AuthDir(d).tenant_settings() == {"share.acme": 3, "max_rate.acme": 100}
    bad = subprocess.run([*run, "add-tenant", str(d), "PLANE"], capture_output=True,
                         text=True, cwd=ROOT)
    assert bad.returncode == 2 and "invalid tenant name" in bad.stderr


def test_a_tenants_limits_default_are_kept_and_read_from_an_older_state(
        auth: AuthDir) -> None:
    conf = auth.conf.read_text()
    assert conf.count("limits: {max_connections: 1000, max_subscriptions: 100000}") == 2
    auth.add_tenant("acme", max_connections=50)  # one setting changed, the others kept
    acme = auth.load().tenants["acme"]
    assert (acme.share, acme.max_rate, acme.max_connections, acme.max_subscriptions) == (
        2, 500, 50, 100_000)
    with pytest.raises(ConfigError, match="--max-subscriptions must be"):
        auth.add_tenant("acme", max_subscriptions=0)
    # An auth.json written before the limits existed: the defaults.
    state = json.loads((auth.path / "auth.json").read_text())
    for t in state["tenants"].values():
        del t["max_connections"], t["max_subscriptions"]
    (auth.path / "auth.json").write_text(json.dumps(state))
    assert auth.load().tenants["acme"].max_connections == 1000

def test_a_tenants_rate_limit_can_be_lifted(auth: AuthDir) -> None:
    """`--max-rate 0` is no limit, as the help says of the default: a limit once set used to
    stay for good (another setting keeps it, and 0 was refused as out of range)."""
    auth.add_tenant("acme", share=3)  # a setting not given keeps its value
    assert auth.load().tenants["acme"].max_rate == 500
    auth.add_tenant("acme", max_rate=0)
    acme = auth.load().tenants["acme"]
    assert (acme.share, acme.max_rate) == (3, None)
    assert auth.tenant_settings() == {"share.acme": 3, "share.beta": 1}
    with pytest.raises(ConfigError, match=r"--max-rate must be 1\.\.1000000 \(or 0 for no "):
        auth.add_tenant("acme", max_rate=-1)


def test_the_allow_lists_follow_the_prefix() -> None:
    perms = {**role_permissions(Names("acme.p")), "tenant": tenant(Names("acme.p"))}
    for role, p in perms.items():
        assert not [s for s in (*p.publish, *p.subscribe) if "plane" in s.lower()], role
    assert perms["tenant"] == Permissions(publish=("acme.p.infer.>", "acme.p.cancel.>"),
                                          subscribe=("_INBOX.>",))


# -- what a tenant cannot do ------------------------------------------------------------------
async def publish(o: Offender, subject: str, data: bytes = b"x") -> str:
    await o.nc.publish(subject, data)
    return subject


async def subscribe(o: Offender, subject: str) -> str:
    await o.nc.subscribe(subject)
    return subject


TENANT_ATTEMPTS: dict[str, Callable[[Offender], Awaitable[str]]] = {
    "publish-to-a-slot": lambda o: publish(o, SLOT, b'{"duration_us": 1}'),
    "publish-a-done-event": lambda o: publish(o, NAMES.done("calibrated", NODE, 0)),
    "write-config": lambda o: publish(o, f"$KV.{NAMES.config_bucket}.deadline_ms.calibrated",
                                      b"1"),
    "write-a-phantom-node": lambda o: publish(o, f"$KV.{NAMES.nodes_bucket}.ghost.calibrated"),
    "open-the-config-bucket": lambda o: publish(
        o, f"$JS.API.STREAM.INFO.KV_{NAMES.config_bucket}"),
    "subscribe-to-the-plane": lambda o: subscribe(o, "plane.>"),
    "subscribe-to-everything": lambda o: subscribe(o, ">"),
    "subscribe-to-import-replies": lambda o: subscribe(o, "_R_.>"),
    "send-a-fault": lambda o: publish(o, NAMES.fault(NODE), b'{"kind": "hang"}'),
}


@pytest.mark.parametrize("attempt", sorted(TENANT_ATTEMPTS))
async def test_a_tenant_is_refused_everything_but_calling(auth: AuthDir, attempt: str) -> None:
    async with secured(auth, allow_faults=True) as plane:
        before = await config_value(plane, "deadline_ms.calibrated")
        async with offender(auth.options("acme", plane.url)) as o:
            subject = await TENANT_ATTEMPTS[attempt](o)
            assert "permissions violation" in await o.refused(subject)
            await still_serving(plane)  # the plane serves on ...
            assert o.nc.is_connected  # ... and the server closed nothing
        assert any("acme" in v and subject in v for v in plane.violations())
        assert await config_value(plane, "deadline_ms.calibrated") == before
        assert all(n.slots[0].claimed for n in plane.stack.nodes)  # no fault took hold


async def test_a_tenant_never_sees_another_tenants_replies(auth: AuthDir) -> None:
    async with secured(auth) as plane:
        beta = await connect(auth.options("beta", plane.url))
        seen: list[str] = []

        async def spy(msg: Msg) -> None:
            seen.append(msg.subject)

        try:
            await beta.subscribe("_INBOX.>", cb=spy)  # allowed: its own account's inboxes
            await beta.flush()
            for _ in range(5):
                await still_serving(plane, "acme")
            await asyncio.sleep(0.2)
            assert seen == []
        finally:
            await beta.close()


# -- what a plane role cannot do --------------------------------------------------------------
async def test_a_node_cannot_write_config(auth: AuthDir) -> None:
    async with secured(auth) as plane:
        before = await config_value(plane, "deadline_ms.calibrated")
        async with offender(auth.options("node", plane.url)) as o:
            subject = await publish(o, f"$KV.{NAMES.config_bucket}.deadline_ms.calibrated",
                                    b"1")
            await o.refused(subject)
            await still_serving(plane)
        assert await config_value(plane, "deadline_ms.calibrated") == before


@pytest.mark.parametrize("subject", [NAMES.health(NODE), NAMES.done("calibrated", NODE, 0),
                                     f"$KV.{NAMES.nodes_bucket}.{NODE}.calibrated"])
async def test_a_router_cannot_speak_as_a_node(auth: AuthDir, subject: str) -> None:
    """Heartbeats, done-events and adverts are the node role's: a router credential is
    refused each. (Nodes share one role: scoping a node to its own id is not done; see
    docs/design.md, "Roles and permissions".)"""
    async with secured(auth) as plane, offender(auth.options("router", plane.url)) as o:
        await o.refused(await publish(o, subject, b"{}"))
        await still_serving(plane)


async def test_no_credentials_no_entry(auth: AuthDir) -> None:
    async with EmbeddedNats(NatsServerSpec(extra_args=auth.server_args())) as server:
        assert not await can_connect(ConnectOptions(url=server.url))
        assert not await can_connect(ConnectOptions(url=server.url, user="admin",
                                                    password="guess"))
        assert await can_connect(auth.options("admin", server.url))


# -- the positive path ------------------------------------------------------------------------
async def test_tenants_are_served_from_python_and_nodejs(auth: AuthDir) -> None:
    if shutil.which("node") is None or not (JS_DIR / "node_modules" / "@nats-io").exists():
        pytest.fail("Node.js client missing: run `make test` (it runs npm ci in tests/js)")
    async with secured(auth, models=("risk", "calibrated"), freshness=True) as plane:
        await still_serving(plane, "acme")
        # More at once than there are slots: refusals with tickets, retried by the SDK.
        async with Client.connect(auth.options("acme", plane.url)) as c:
            burst = await asyncio.gather(*(
                c.invoke("calibrated", {"duration_us": 50_000}, deadline_ms=5000)
                for _ in range(6)))
            assert max(r.attempts for r in burst) > 1
            assert (await c.invoke("risk", {"features": [0.0] * 32})).node == "node0-risk"
        # Live settings reach every router and node through their watches.
        admin = await connect(auth.options("admin", plane.url))
        kv = await admin.jetstream().key_value(NAMES.config_bucket)
        await kv.put("deadline_ms.calibrated", b"777")
        await admin.close()
        async with asyncio.timeout(5):
            while not all(r.settings.deadline_ms("calibrated") == 777
                          for r in plane.stack.routers) or not all(
                              n.settings.deadline_ms("calibrated") == 777
                              for n in plane.stack.nodes):
                await asyncio.sleep(0.02)
        assert all(r.settings.get("share", "acme") == 2 for r in plane.stack.routers)
        beta = auth.options("beta", plane.url)
        proc = await asyncio.create_subprocess_exec(
            "node", "--input-type=module", "-e", NODE_TENANT, cwd=JS_DIR,
            env={**os.environ, "URL": plane.url, "USER_NAME": beta.user or "",
                 "PASSWORD": beta.password or ""},
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await asyncio.wait_for(proc.communicate(), 60)
        assert proc.returncode == 0, err.decode()
        answer = json.loads(out)
        assert answer["status"] == "200" and answer["node"] == NODE
        assert answer["body"] == {"duration_us": 1000}
        # The plane's own roles ran with exactly their allow lists: nothing was refused.
        assert plane.violations() == []


NODE_TENANT = """
import { connect, headers } from "@nats-io/transport-node";
const nc = await connect({ servers: process.env.URL, user: process.env.USER_NAME,
                           pass: process.env.PASSWORD });
const h = headers();
h.set("Plane-Deadline-Ms", "2000");
const msg = await nc.request("plane.infer.calibrated",
  new TextEncoder().encode(JSON.stringify({ duration_us: 1000 })), { timeout: 5000, headers: h });
console.log(JSON.stringify({ status: msg.headers?.get("Plane-Status"),
  node: msg.headers?.get("Plane-Node"), body: JSON.parse(new TextDecoder().decode(msg.data)) }));
await nc.close();
"""


@pytest.mark.parametrize("slot_shards", [None, 2], ids=["shared", "sharded"])
async def test_failures_are_answered_under_the_roles(auth: AuthDir,
                                                     slot_shards: int | None) -> None:
    """A hung slot (admin's fault drill): the node takes the message and answers the tenant
    503 through the import's reply subject; the slot is withdrawn, reclaimed (its consumer
    deleted and made again, its subject swept) and serves again. Nothing refused, with one
    slot stream or a cluster's shards (`JS.STREAM.NAMES`, the shards' own names)."""
    async with secured(auth, slots=1, allow_faults=True, slot_shards=slot_shards) as plane:
        want = NAMES.slots_stream if slot_shards is None else NAMES.slot_shard_stream(0)
        assert plane.stack.nodes[0].slots[0].stream == want
        admin = await connect(auth.options("admin", plane.url))
        acme = await connect(auth.options("acme", plane.url))
        try:
            for mode in ("hang", "none"):
                ok = await admin.request(NAMES.fault(NODE), json_encoder.encode(
                    FaultCommand(k=0, mode=mode)), timeout=2)
                assert ok.data == b"ok"
                if mode == "hang":
                    m = await acme.request(NAMES.infer("calibrated"), b'{"duration_us": 1000}',
                                           headers={Header.DEADLINE_MS: "5000"}, timeout=6)
                    assert (m.headers or {}).get(Header.STATUS) == "503"
            async with asyncio.timeout(10):
                while True:
                    m = await acme.request(NAMES.infer("calibrated"), b'{"duration_us": 1000}',
                                           headers={Header.DEADLINE_MS: "2000"}, timeout=5)
                    if (m.headers or {}).get(Header.STATUS) == "200":
                        break
                    await asyncio.sleep(0.1)
        finally:
            await admin.close()
            await acme.close()
        assert plane.violations() == []


async def test_the_gateway_role_calls_and_checks_readiness(auth: AuthDir) -> None:
    async with secured(auth) as plane:
        gw = await connect(auth.options("gateway", plane.url))
        try:
            await gw.request(f"$SRV.PING.{NAMES.router_service}", b"", timeout=5)
            answer = await gw.request(NAMES.infer("calibrated"), b'{"duration_us": 1000}',
                                      headers={Header.TENANT: "acme"}, timeout=5)
        finally:
            await gw.close()
        assert (answer.headers or {}).get(Header.STATUS) == "200"
        assert plane.violations() == []


async def test_the_router_learns_the_tenant_from_the_server(auth: AuthDir) -> None:
    """What the responder sees of a request that came through the service import: the
    server's `Nats-Request-Info` naming the requesting account, whatever the caller sent."""
    async with secured(auth) as plane:
        admin = await connect(auth.options("admin", plane.url))
        seen: asyncio.Queue[dict[str, str]] = asyncio.Queue()

        async def look(msg: Msg) -> None:
            await seen.put(dict(msg.headers or {}) | {"reply": msg.reply or ""})

        try:
            await admin.subscribe(NAMES.infer("calibrated"), cb=look)
            await admin.flush()
            acme = await connect(auth.options("acme", plane.url))
            forged = {Header.NATS_REQUEST_INFO: '{"acc":"beta"}', Header.TENANT: "beta",
                      Header.DEADLINE_MS: "2000"}
            await acme.request(NAMES.infer("calibrated"), b'{"duration_us": 1000}',
                               headers=forged, timeout=5)
            await acme.close()
            got = await asyncio.wait_for(seen.get(), 5)
        finally:
            await admin.close()
        info = json.loads(got[Header.NATS_REQUEST_INFO])
        assert info["acc"] == "acme" and info["user"] == "acme"  # the server's, not forged
        assert got["reply"].startswith("_R_.")  # the import's reply subject


async def test_a_tenant_added_while_running_is_served_without_a_restart(auth: AuthDir) -> None:
    async with secured(auth) as plane:
        pid = plane.server.pid
        assert not await can_connect(ConnectOptions(url=plane.url, user="gamma",
                                                    password="x"))
        auth.add_tenant("gamma", share=5)
        assert await asyncio.to_thread(auth.reload)
        assert await tenant_let_in(auth, "gamma", plane.url, within_s=10), "never let in"
        await still_serving(plane, "gamma")
        assert plane.server.pid == pid and plane.server.running
        await still_serving(plane, "acme")
        # The plane's own connections lived through both reloads.
        assert plane.stack.clients and all(nc.stats["reconnects"] == 0
                                           for nc in plane.stack.clients)


async def test_a_tenants_account_limits_bound_its_connections_and_subscriptions(
        auth: AuthDir) -> None:
    """One tenant's runaway client (a connection per call, a subscription per call never
    closed) is stopped by its account's limits, not by the server's, which all share."""
    auth.add_tenant("beta", max_connections=2, max_subscriptions=3)
    assert "limits: {max_connections: 2, max_subscriptions: 3}" in auth.conf.read_text()
    async with secured(auth) as plane:
        beta = auth.options("beta", plane.url)
        async with offender(beta) as first, offender(beta):
            assert not await can_connect(beta), "a third connection was let in"
            for i in range(3):
                await first.nc.subscribe(f"_INBOX.limit.{i}")
            await first.nc.subscribe("_INBOX.limit.3")  # one too many
            await first.nc.flush()

            def refused_to(what: bytes) -> bool:  # nats-py reports no error for it
                return any(b"beta/user:beta" in line and what in line
                           for line in plane.server.log_tail)

            await wait_until(lambda: refused_to(b"maximum subscriptions exceeded"), 5,
                             "the server to refuse beta's fourth subscription")
        await still_serving(plane, "acme")  # the default limits leave room for the others
        await still_serving(plane, "beta")  # and its connections, closed, count no more


async def test_an_sdk_client_past_its_accounts_subscription_limit_says_so(
        auth: AuthDir) -> None:
    """nats-py closes a connection the server sent "maximum subscriptions exceeded" and tells
    no error callback: the call in flight, and every one after, says so rather than "no
    answer"."""
    auth.add_tenant("gamma", max_subscriptions=1)  # a call takes two: its inbox, its wake
    async with secured(auth) as plane:
        async with Client.connect(auth.options("gamma", plane.url)) as c:
            with pytest.raises(ConnectionClosed, match="maximum subscriptions exceeded") as e:
                await c.invoke("calibrated", {"duration_us": 1000}, deadline_ms=1000)
            assert "plane auth add-tenant" in str(e.value)
            assert e.value.why == "nats: maximum subscriptions exceeded"
            with pytest.raises(ConnectionClosed, match="maximum subscriptions exceeded"):
                await c.invoke("calibrated", {"duration_us": 1000}, deadline_ms=1000)
            with pytest.raises(ConnectionClosed, match="maximum subscriptions exceeded"):
                await c.stream("tinylm", {"prompt": "hi", "max_tokens": 4}).start()
        await still_serving(plane, "acme")


async def test_add_tenant_lifts_a_rate_limit_on_a_running_plane(auth: AuthDir) -> None:
    """With --nats URL, `--max-rate 0` deletes the tenant's `max_rate.<t>` from PLANE_CONFIG
    (the routers follow a deletion as a change); its other settings stay."""
    async with secured(auth) as plane:
        assert await config_value(plane, "max_rate.acme") == b"500"
        # beta has no limit in DIR; one set by hand in PLANE_CONFIG is the operator's, and
        # lifting acme's must leave it (every limitless tenant's was deleted: found in review).
        await put_config_value(plane, "max_rate.beta", b"40")
        out = await asyncio.to_thread(
            subprocess.run, [PLANE, "auth", "add-tenant", str(auth.path), "acme",
                             "--max-rate", "0", "--nats", plane.url],
            capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 0, out
        assert await config_value(plane, "max_rate.acme") is None
        assert await config_value(plane, "share.acme") == b"2"
        assert await config_value(plane, "max_rate.beta") == b"40"


PASSWORD = re.compile(r'password: "[^"]*"')


async def test_add_tenant_says_when_the_running_server_did_not_take_the_config(
        auth: AuthDir) -> None:
    """A server started with a config from before the system account (2026-12-01): a reload
    cannot add one (nats-server logs "config reload not supported for SystemAccount" and
    keeps the old config), so the new tenant (in the config `add-tenant` writes, with the
    account) is not let in. `add-tenant --nats` says so and fails, where it used to report
    "the running server reloaded it"; after a restart the tenant is in. It says too that the
    tenant IS written, and prints its credentials first (--json): the user can use it."""
    kept: list[str] = []
    in_sys_block = False
    for line in auth.conf.read_text().splitlines():  # the lines the system account added
        if line.startswith('  "SYS": {'):
            in_sys_block = True
        elif in_sys_block:
            in_sys_block = line != "  }"
        elif "SYS" not in PASSWORD.sub("", line):  # a bcrypt hash may hold those letters
            kept.append(line)  # (a user's line went with them: the config did not parse)
    older = "\n".join(kept) + "\n"
    assert "system_account" not in older and "$SYS" not in PASSWORD.sub("", older)
    assert "users:" in older
    auth.conf.write_text(older)
    async with EmbeddedNats(NatsServerSpec(extra_args=auth.server_args())) as server:
        await plane_settings_bucket(auth, server.url)  # a plane ran there
        out = await asyncio.to_thread(
            subprocess.run, [PLANE, "auth", "add-tenant", str(auth.path), "gamma", "--nats",
                             server.url, "--json"], capture_output=True, text=True, cwd=ROOT)
        assert out.returncode == 1, out
        assert "did not take it on reload" in out.stderr and "restart" in out.stderr
        assert "tenant gamma IS written to" in out.stderr
        login = json.loads(out.stdout)["gamma"]
        gamma = ConnectOptions(url=server.url, user=login["user"], password=login["password"])
        assert not await can_connect(gamma)
        await server.restart()
        assert await can_connect(gamma)


async def plane_settings_bucket(auth: AuthDir, url: str) -> None:
    """PLANE_CONFIG at `url`, as a plane that ran there leaves it."""
    nc = await connect(auth.options("admin", url))
    try:
        await ensure_config_bucket(nc.jetstream(), NAMES)
    finally:
        await nc.close()


@pytest.mark.parametrize("plane_ran", [False, True], ids=["no server", "no plane"])
async def test_add_tenant_writes_nothing_when_the_plane_cannot_take_it(
        auth: AuthDir, plane_ran: bool) -> None:
    """`add-tenant --nats URL` with nothing at URL (or a server with no plane yet) wrote the
    tenant, then failed: a tenant in the files whose password, with --json, was never
    printed. Now it asks first, and leaves DIR as it was."""
    before = {f: (auth.path / f).read_bytes() for f in ("auth.json", "nats.conf")}
    async with contextlib.AsyncExitStack() as started:
        url = "nats://127.0.0.1:1"
        if plane_ran:
            server = await started.enter_async_context(
                EmbeddedNats(NatsServerSpec(extra_args=auth.server_args())))
            url = server.url
        out = await asyncio.to_thread(
            subprocess.run, [PLANE, "auth", "add-tenant", str(auth.path), "gamma", "--nats",
                             url, "--json"], capture_output=True, text=True, cwd=ROOT,
            timeout=60)
    assert out.returncode == 2 and out.stdout == "", out
    assert out.stderr.startswith("error: ") and "Nothing was written" in out.stderr
    assert ("no bucket PLANE_CONFIG" if plane_ran else "cannot connect to NATS") in out.stderr
    assert {f: (auth.path / f).read_bytes() for f in before} == before


async def test_plane_up_auth_serves_with_the_roles(auth: AuthDir) -> None:
    """`plane up --auth DIR --demo`: the embedded server runs DIR/nats.conf, each part its
    role, and the demo's calls (as admin) are answered."""
    proc = await asyncio.create_subprocess_exec(
        PLANE, "up", "--auth", str(auth.path), "--demo",
        "--models", "calibrated", "--slots", "2", cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    out, _ = await asyncio.wait_for(proc.communicate(), 120)
    text = out.decode()
    assert proc.returncode == 0, text
    assert "calibrated: 200" in text and "429" in text
    # The banner says that its example calls need a login, and where the logins are (not
    # the logins themselves: a banner ends up in logs).
    assert f"credentials: required; every role's and tenant's user and password are in " \
           f"{auth.path / 'auth.json'}" in text, text
    assert auth.options("admin").password not in text


async def test_the_compose_router_health_check_passes_as_its_role(auth: AuthDir) -> None:
    """compose's router-1 health check, its very command, as the role compose gives it,
    against `plane up --auth`: it passes (it never could: `plane status` asked on bare
    `$SRV.INFO`, which the role's `$SRV.INFO.>` does not match, and said "no router
    answers"). As a role without those rights it fails naming what the server refused,
    never as an outage ("no router answers", "no leader")."""
    router1 = yaml.safe_load((ROOT / "compose" / "docker-compose.yml").read_text())[
        "services"]["router-1"]
    _, role = router1["environment"]["PLANE_AUTH"].rsplit(":", 1)
    command = router1["healthcheck"]["test"]
    assert command[:3] == ["CMD", "plane", "status"], command
    proc = await asyncio.create_subprocess_exec(
        PLANE, "up", "--auth", str(auth.path), "--models", "calibrated", "--slots", "2",
        "--log-level", "warning", cwd=ROOT, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT)
    try:
        assert proc.stdout is not None
        lines: list[str] = []
        async with asyncio.timeout(90):
            while "Ctrl-C" not in (line := (await proc.stdout.readline()).decode()):
                assert line, "".join(lines)
                lines.append(line)
        url = next(m.group(1) for x in lines if (m := re.match(r"plane is up: NATS (\S+)", x)))
        # The check's own arguments, but for where this plane is: its URL, its router's id.
        args = [*command[2:]]
        args[args.index("--nats") + 1] = url
        args[args.index("--router") + 1] = "router0"

        async def check(as_role: str, argv: list[str]) -> tuple[int, str]:
            env = {**os.environ, "PLANE_AUTH": f"{auth.path}:{as_role}"}
            out = await asyncio.create_subprocess_exec(
                PLANE, *argv, "--json", env=env, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT)
            text, _ = await asyncio.wait_for(out.communicate(), 30)
            assert out.returncode is not None
            return out.returncode, text.decode()

        code, text = await check(role, args)
        assert code == 0, text
        plane_wide = args[:args.index("--router")] + args[args.index("--router") + 2:]
        code, text = await check(role, plane_wide)  # the whole plane's health, as the role
        assert code == 0 and json.loads(text)["problems"] == [], text
        code, text = await check("gateway", args)
        problems = json.loads(text)["problems"]
        assert code == 1 and problems, text
        assert any(p.startswith(f'not allowed: user "gateway" may not publish to $SRV.INFO.'
                                f"{NAMES.router_service} ") for p in problems), problems
        assert not [p for p in problems if "no router answers" in p or "no leader" in p], problems
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            await asyncio.wait_for(proc.wait(), 60)


async def test_the_bridge_role_feeds_features_the_node_role_reads(
    auth: AuthDir, tansu: EmbeddedTansu, kafka_topic: Callable[..., Awaitable[str]]
) -> None:
    """Kafka -> bridge -> PLANE_EVENTS -> feature updater -> PLANE_FEATURES -> a node's
    guard, each with its role: every step allowed, nothing refused."""
    topic = await kafka_topic("transactions", partitions=1)
    async with EmbeddedNats(NatsServerSpec(extra_args=auth.server_args())) as server:
        bridge_nc = await connect(auth.options("bridge", server.url))
        node_nc = await connect(auth.options("node", server.url))
        cfg = BridgeConfig(kafka_bootstrap=tansu.bootstrap, topics=(topic,),
                           session_timeout_ms=SESSION_TIMEOUT_MS,
                           heartbeat_interval_ms=SESSION_TIMEOUT_MS // 6)
        try:
            async with (
                KafkaBridge(bridge_nc, cfg) as bridge,
                FeatureUpdater(bridge_nc, UpdaterConfig(topic=topic)) as updater,
                CardFeatureGuard(node_nc, NAMES, GuardConfig()) as guard,
            ):
                await bridge.wait_assigned()
                await produce(tansu.bootstrap, topic, [txn_line(i, "c1") for i in range(5)])
                async with asyncio.timeout(30):
                    while updater.applied < 5 or "c1" not in guard._latest:
                        await asyncio.sleep(0.02)
        finally:
            await bridge_nc.close()
            await node_nc.close()
        assert [line.decode() for line in server.violations] == []


def test_plane_auth_env_connects_as_a_role(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """PLANE_AUTH=DIR:ROLE (what compose/ sets on each service) gives that role's user and
    password from DIR; explicit credentials win; a malformed value is a clear error."""
    from plane.cli import make_connect

    d = AuthDir(tmp_path / "auth", rounds=4)
    state = d.init("plane")
    monkeypatch.setenv("PLANE_AUTH", f"{d.path}:router")
    opts = make_connect("nats://127.0.0.1:1", None, None, None, None, None, "plane-router")
    assert (opts.user, opts.password) == ("router", state.roles["router"].password)
    assert opts.url == "nats://127.0.0.1:1" and opts.name == "plane-router"
    mine = make_connect("nats://127.0.0.1:1", "me", "pw", None, None, None)
    assert (mine.user, mine.password) == ("me", "pw")
    monkeypatch.setenv("PLANE_AUTH", "no-role-here")
    with pytest.raises(ConfigError, match="DIR:ROLE"):
        make_connect(None, None, None, None, None, None)


@asynccontextmanager
async def slowed_streams(auth: AuthDir, plane: Secured) -> AsyncIterator[list[DoneEvent]]:
    """The done-events of `plane` as they come (heard as admin), with tinylm's slot made
    3 ms a token slower (200 tokens: 0.6 s, time for a cancel or a caller gone to stop it)."""
    admin = await connect(auth.options("admin", plane.url))
    events: list[DoneEvent] = []

    async def keep(msg: Msg) -> None:
        events.extend(read_done(msg.data, batch=NAMES.is_done_batch(msg.subject)))

    try:
        await admin.subscribe(NAMES.done_all(), cb=keep)
        slow = FaultCommand(k=0, mode="slow", extra_us=3000)
        await admin.request(NAMES.fault("node0-tinylm"), json_encoder.encode(slow), timeout=2)
        yield events
    finally:
        await admin.close()


async def done_of(events: list[DoneEvent], request_id: str) -> DoneEvent:
    async with asyncio.timeout(5):
        while not (done := [e for e in events if e.request_id == request_id]):
            await asyncio.sleep(0.01)
    return done[0]


async def test_a_tenant_streams_and_cancels_through_its_account(auth: AuthDir) -> None:
    """A stream's messages all cross the service import (`response_type: stream`: with the
    default, a tenant saw the start and nothing after it), and a tenant's cancel reaches the
    node through the imported `plane.cancel.>`. Across an import the server tells the node
    nothing when the tenant stops reading (no no-responders status comes back, checked), so
    the slot frees here only because the cancel arrived."""
    async with secured(auth, models=("tinylm",), slots=1, allow_faults=True) as plane, \
            slowed_streams(auth, plane) as dones:
        async with Client.connect(auth.options("acme", plane.url)) as c:
            whole = c.stream("tinylm", {"prompt": "The plane", "max_tokens": 60},
                             deadline_ms=5000)
            pieces = [p async for p in whole]
            assert len(pieces) >= 2 and len("".join(pieces)) == 60
            assert whole.finish_reason == "length" and whole.usage is not None
            async with c.stream("tinylm", {"prompt": "The plane", "max_tokens": 200},
                                deadline_ms=5000) as early:
                async for _ in early:
                    break
        done = await done_of(dones, early.request_id)
        assert done.tokens < 100  # stopped by the cancel, not run to its 200 tokens
    assert plane.violations() == []


async def test_a_tenant_that_vanishes_mid_stream_frees_the_slot(auth: AuthDir) -> None:
    """A tenant's connection closes mid-stream, no cancel sent. No no-responders status
    comes back across the import (the test above), so the node hears it from the server's
    advisory of the closed connection (`$SYS.ACCOUNT.*.DISCONNECT`, imported under `plane
    auth`), matched by the connection the router named on the slot message: the stream stops
    there, not at its 200th token or its deadline."""
    async with secured(auth, models=("tinylm",), slots=1, allow_faults=True) as plane, \
            slowed_streams(auth, plane) as dones:
        opts = auth.options("acme", plane.url)
        assert opts.url is not None
        caller = await nats.connect(opts.url, user=opts.user, password=opts.password,
                                    allow_reconnect=False)
        inbox = caller.new_inbox()
        sub = await caller.subscribe(inbox)
        body = json.dumps({"prompt": "The plane", "max_tokens": 200}).encode()
        await caller.publish(NAMES.infer("tinylm"), body, reply=inbox, headers={
            Header.STREAM: "1", Header.DEADLINE_MS: "5000", Header.REQUEST_ID: "vanish-1"})
        await sub.next_msg(timeout=5)  # the start
        await sub.next_msg(timeout=5)  # a token: the stream runs
        caller._transport.close()  # gone without a word (no cancel, no unsubscribe)
        done = await done_of(dones, "vanish-1")
        assert done.tokens < 100, done  # stopped when the caller went, not at 200
        assert plane.stack.nodes[0].streams.readers_gone == 1
        with contextlib.suppress(Exception):
            await caller.close()
    assert plane.violations() == []


async def test_the_gateway_role_may_cancel(auth: AuthDir) -> None:
    async with secured(auth) as plane, offender(auth.options("gateway", plane.url)) as gw:
        await gw.nc.publish(NAMES.cancel("node0-calibrated", 0), b"",
                            headers={Header.REQUEST_ID: "gone"})
        await gw.nc.flush()
        await asyncio.sleep(0.2)
        assert gw.errors == [] and plane.violations() == []


async def test_a_tenant_cannot_cancel_another_tenants_stream(auth: AuthDir) -> None:
    """Request ids can be guessed: a cancel counts only from the account that sent the stream
    (the router names it on the slot message) or from inside the plane's own account."""
    async with secured(auth, models=("tinylm",), slots=1) as plane:
        beta = await connect(auth.options("beta", plane.url))
        try:
            async with Client.connect(auth.options("acme", plane.url)) as c:
                # 200 tokens: ~50 ms on the slot, beta's cancel reaches the node in ~1 ms.
                s = c.stream("tinylm", {"prompt": "The plane", "max_tokens": 200},
                             deadline_ms=5000)
                cancelled_by_beta = False
                async for _ in s:
                    if not cancelled_by_beta:
                        cancel_subject = (s.start_headers or {})[Header.CANCEL_SUBJECT]
                        await beta.publish(cancel_subject, b"",
                                           headers={Header.REQUEST_ID: s.request_id})
                        await beta.flush()
                        cancelled_by_beta = True
                assert s.finish_reason == "length"  # beta's cancel changed nothing
                assert s.usage is not None and s.usage.completion_tokens == 200
            assert plane.stack.nodes[0].streams.refused == 1
        finally:
            await beta.close()
        assert plane.violations() == []


async def test_a_tenants_request_forwarded_between_routers_is_answered_across_its_import(
        auth: AuthDir) -> None:
    """Two routers under the roles. A tenant's request reaches the router that makes no
    promises while the slot is busy: it is forwarded to the one that does, which takes it
    over and answers the tenant's import reply (`_R_...`) itself, as its node does for a
    ticket holder's retry: every request gets its one answer, none a violation."""
    async with secured(auth, slots=1, routers=2) as plane:
        acme = await connect(auth.options("acme", plane.url))
        try:
            busy = asyncio.create_task(acme.request(
                NAMES.infer("calibrated"), b'{"duration_us": 400000}', timeout=5,
                headers={Header.DEADLINE_MS: "3000"}))
            await wait_until(lambda: any(s.current is not None for s in
                                         plane.stack.nodes[0].slots), 5, "the slot busy")
            refused = [await acme.request(NAMES.infer("calibrated"),
                                          b'{"duration_us": 1000}', timeout=5,
                                          headers={Header.DEADLINE_MS: "3000"})
                       for _ in range(8)]  # half of them land on the router that forwards
            assert [m.headers[Header.STATUS] for m in refused] == ["429"] * 8
            assert (await busy).headers[Header.STATUS] == "200"
            served = [await acme.request(NAMES.infer("calibrated"), b'{"duration_us": 1000}',
                                         timeout=5, headers={
                                             Header.DEADLINE_MS: "3000",
                                             Header.TICKET: m.headers[Header.TICKET]})
                      for m in refused]
            assert [m.headers[Header.STATUS] for m in served] == ["200"] * 8
        finally:
            await acme.close()
        taken = plane.stack.metrics.registry.get_sample_value
        assert (taken("plane_router_forwarded_total", {
            "model": "calibrated", "why": "promise", "outcome": "taken"}) or 0) + (taken(
                "plane_router_forwarded_total", {"model": "calibrated", "why": "ticket",
                                                 "outcome": "taken"}) or 0) >= 1
    assert plane.violations() == []


def test_a_violation_is_kept_however_many_lines_the_server_logs_after_it() -> None:
    """The roles' checks read every violation the server logged, not the last lines only: a
    busy cluster's test logs hundreds after one (leader moves, consumers made)."""
    server = EmbeddedNats()
    line = b"[ERR] 127.0.0.1:5 - cid:9 - \"v1.2:python:acme\" - Publish Violation - ...\n"
    server._remember(line)
    for i in range(1000):
        server._remember(f"[INF] line {i}\n".encode())
    assert line not in server.log_tail and server.violations == [line]
