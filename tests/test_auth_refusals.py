"""A server's refusal of a connection, told as such and at once: wrong credentials, an account
at its connection limit, credentials revoked while connected (`plane.contract.refusals`), on
a real nats-server running `plane auth`'s config (the fixtures of `tests/test_auth.py`)."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from plane.auth.live import can_connect
from plane.auth.store import AuthDir
from plane.client import Client, ConnectFailed
from plane.contract.config import ConnectOptions
from plane.contract.embedded import EmbeddedNats, NatsServerSpec
from plane.contract.errors import ConfigError, ConnectionClosed, Unavailable
from plane.contract.natsconn import connect
from tests.test_auth import auth, secured, still_serving

__all__ = ["auth"]  # a fixture, imported for pytest

ROOT = Path(__file__).parent.parent
PLANE = [sys.executable, "-m", "plane"]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def tries(server: EmbeddedNats, sign: bytes) -> int:
    """The connections the server refused with a log line holding `sign` (it logs one or
    two lines per connection, each naming its `cid`)."""
    return len({m.group(1) for line in server.log_tail if sign in line
                and (m := re.search(rb" - cid:(\d+) - ", line))})


def served(auth: AuthDir) -> EmbeddedNats:
    return EmbeddedNats(NatsServerSpec(extra_args=auth.server_args()))


async def test_a_connection_past_the_accounts_limit_is_refused_once_naming_the_limit(
        auth: AuthDir) -> None:
    """The server sends `-ERR 'maximum account active connections exceeded'` and closes; the
    SDK tried again and again, and its message was often the reset of a later try with "Is a
    plane running there?". Now: the first refusal ends it, and the message says what to do."""
    auth.add_tenant("beta", max_connections=1)
    async with served(auth) as server:
        beta = auth.options("beta", server.url)
        async with Client.connect(beta):
            for _ in range(3):
                with pytest.raises(ConnectFailed) as e:
                    async with Client.connect(beta):
                        pass
                said = str(e.value)
                assert "maximum account active connections exceeded" in said, said
                assert "--max-connections" in said and "Is a plane running" not in said, said
                assert e.value.url == server.url
        assert tries(server, b"maximum account active connections exceeded") == 3


async def test_wrong_credentials_are_refused_once_saying_to_check_them(auth: AuthDir) -> None:
    async with served(auth) as server:
        with pytest.raises(ConnectFailed) as e:
            async with Client.connect(ConnectOptions(url=server.url, user="acme",
                                                     password="wrong")):
                pass
        said = str(e.value)
        assert "Authorization Violation" in said and "refused the credentials" in said, said
        assert "Is a plane running" not in said, said
        assert tries(server, b"authentication error") == 1


async def test_a_roles_connection_refused_its_credentials_ends_at_once(auth: AuthDir) -> None:
    """router, node, gateway: nats-py's 40 tries over ten seconds, each refused, then the
    right message; now one try."""
    async with served(auth) as server:
        with pytest.raises(Unavailable) as e:
            await connect(ConnectOptions(url=server.url, user="node", password="wrong"))
        said = str(e.value)
        assert "Authorization Violation" in said and "refused the credentials" in said, said
        assert "--user/--password" in said, said
        assert tries(server, b"authentication error") == 1


async def test_plane_router_with_no_credentials_exits_2_after_one_try(auth: AuthDir) -> None:
    async with served(auth) as server:
        out = await asyncio.to_thread(
            subprocess.run, [*PLANE, "router", "--nats", server.url], capture_output=True,
            text=True, cwd=ROOT, env=ENV, timeout=60)
        assert out.returncode == 2, out
        assert "Authorization Violation" in out.stderr, out.stderr
        assert "refused the credentials" in out.stderr, out.stderr
        assert tries(server, b"authentication error") == 1


def test_a_url_that_is_no_url_is_said_to_be_one_at_once() -> None:
    """`PLANE_NATS=garbage`: nats-py reads it as the host "garbage", port 4222, and a role
    tried to resolve it for ten seconds. Without a scheme, a name that does not resolve is
    taken for what it is."""
    out = subprocess.run([*PLANE, "router"], capture_output=True, text=True, cwd=ROOT,
                         env={**ENV, "PLANE_NATS": "garbage.invalid"}, timeout=60)
    assert out.returncode == 2, out
    assert "garbage.invalid is no host name that resolves" in out.stderr, out.stderr
    assert "nats://HOST:PORT" in out.stderr, out.stderr


async def test_a_scheme_less_url_that_is_no_url_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="nats://HOST:PORT"):
        await connect(ConnectOptions(url="garbage.invalid"))
    with pytest.raises(ConfigError, match="nats://HOST:PORT"):
        async with Client.connect("garbage.invalid"):
            pass


async def plane_auth(*argv: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(subprocess.run, [*PLANE, "auth", *argv],
                                   capture_output=True, text=True, cwd=ROOT, env=ENV,
                                   timeout=60)


async def test_a_tenant_removed_while_connected_is_told_its_credentials_were_refused(
        auth: AuthDir) -> None:
    """`plane auth remove-tenant` on a running plane: the server drops the tenant's
    connection at the reload and refuses its reconnects. The SDK went on reconnecting, and
    every call came back a local 504 "the connection stayed down ...; try again shortly";
    now the client closes after the second refusal and each call raises `ConnectionClosed`
    naming the authorization violation and what to do."""
    auth.add_tenant("gamma")
    async with secured(auth) as plane:
        gamma = auth.options("gamma", plane.url)
        async with Client.connect(gamma) as c:
            ok = await c.invoke("calibrated", {"duration_us": 1000}, deadline_ms=2000)
            assert ok.status == 200
            out = await plane_auth("remove-tenant", str(auth.path), "gamma")
            assert out.returncode == 0 and "the running server reloaded it" in out.stdout, out
            for _ in range(2):  # the call in flight at the close, and one after it
                with pytest.raises(ConnectionClosed) as e:
                    await c.call("calibrated", {"duration_us": 1000}, deadline_ms=5000)
                said = str(e.value)
                assert e.value.why == "nats: 'Authorization Violation'", said
                assert "refused the credentials" in said and "try again" not in said, said
        with pytest.raises(ConnectFailed, match="refused the credentials"):
            async with Client.connect(gamma):
                pass
        await still_serving(plane, "acme")
    out = await plane_auth("remove-tenant", str(auth.path), "gamma")
    assert out.returncode == 2 and "has no tenant 'gamma'" in out.stderr, out


async def test_a_tenants_new_password_shuts_the_old_one_out(auth: AuthDir) -> None:
    async with secured(auth) as plane:
        old = auth.options("beta", plane.url)
        async with Client.connect(old) as c:
            await c.invoke("calibrated", {"duration_us": 1000}, deadline_ms=2000)
            out = await plane_auth("add-tenant", str(auth.path), "beta", "--new-password",
                                   "--json")
            assert out.returncode == 0, out
            with pytest.raises(ConnectionClosed, match="refused the credentials"):
                await c.call("calibrated", {"duration_us": 1000}, deadline_ms=5000)
        new = auth.options("beta", plane.url)
        assert new.password != old.password and new.password in out.stdout
        assert not await can_connect(old)
        assert await can_connect(new)
        await still_serving(plane, "beta")


async def plane_status(url: str, opts: ConnectOptions, *more: str) -> tuple[int, str]:
    assert opts.user is not None and opts.password is not None
    out = await asyncio.to_thread(
        subprocess.run, [*PLANE, "status", "--nats", url, "--user", opts.user,
                         "--password", opts.password, *more],
        capture_output=True, text=True, cwd=ROOT, env={**ENV, "COLUMNS": "400"}, timeout=60)
    return out.returncode, out.stdout + out.stderr


async def test_status_refused_its_credentials_says_only_that(auth: AuthDir) -> None:
    """It printed empty routers and nodes tables first, as if a plane with nothing in it."""
    async with served(auth) as server:
        code, text = await plane_status(server.url, ConnectOptions(user="admin",
                                                                   password="wrong"))
    assert code == 1, text
    assert "UNHEALTHY" in text and "refused the credentials" in text, text
    assert "routers" not in text and "nodes" not in text, text


async def test_status_as_a_tenant_says_once_to_run_it_as_admin(auth: AuthDir) -> None:
    async with secured(auth) as plane:
        code, text = await plane_status(plane.url, auth.options("acme"), "--json")
    problems = json.loads(text)["problems"]
    assert code == 1, text
    assert len(problems) == 1, problems
    assert problems[0].startswith('not allowed: user "acme" may not publish to '), problems
    assert "run it as admin" in problems[0], problems
