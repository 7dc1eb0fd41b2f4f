"""The auth directory: what `plane auth init` and `plane auth add-tenant` write, and what
`plane up --auth DIR` reads.

    DIR/auth.json   the source of truth: every role's and tenant's user, password and bcrypt
                    hash, and each tenant's settings (mode 0600: it holds the secrets)
    DIR/nats.conf   generated from it (`plane.auth.conf`); holds hashes only, mode 0600 too
    DIR/nats.pid    written by a nats-server running that config when told so (`-P`, as
                    `plane up --auth DIR` does): how `add-tenant` finds the server to reload

`init` on a directory that has one keeps its secrets (rewrites nats.conf, prints the same
options): a running plane's credentials never change behind its back.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from collections.abc import Mapping
from pathlib import Path

import msgspec

from plane.auth.conf import TenantAccount, render
from plane.auth.roles import ROLES
from plane.contract.config import ConnectOptions
from plane.contract.errors import ConfigError
from plane.contract.settings import RANGES
from plane.contract.subjects import TOKEN_RE, Names, config_key

STATE_FILE = "auth.json"
CONF_FILE = "nats.conf"
PID_FILE = "nats.pid"
PLANE_ACCOUNT = "PLANE"
# Account names a tenant cannot take: the plane's, the server's own, and the tenant names
# the router keeps for requests with no tenant and for tenants beyond its limit.
RESERVED = {PLANE_ACCOUNT, "SYS", "$SYS", "$G", "default", "other", *ROLES}
# See `AuthDir.reload`: the second reload of two wires a new tenant's import.
RELOAD_AGAIN_AFTER_S = 0.5
BCRYPT_ROUNDS = 11  # what `nats server passwd` uses; the server pays it once per connect


class Secret(msgspec.Struct, frozen=True, kw_only=True):
    user: str
    password: str
    hash: str


# A tenant account's limits unless `add-tenant` says otherwise: room for a fleet of callers
# (each SDK connection holds a few subscriptions, and one per stream it reads), a bound on a
# runaway one. nats-server's own defaults are 64k connections and no subscription limit.
DEFAULT_MAX_CONNECTIONS = 1_000
DEFAULT_MAX_SUBSCRIPTIONS = 100_000
LIMIT_RANGES = {"max_connections": (1, 1_000_000), "max_subscriptions": (1, 10_000_000)}
# `add-tenant --max-rate 0`: no rate limit, a new tenant's default. Without it a limit once
# set could never be lifted (a setting not given keeps its value, and 0 was out of range).
NO_RATE_LIMIT = 0


class Tenant(msgspec.Struct, frozen=True, kw_only=True):
    login: Secret
    share: int = 1
    max_rate: int | None = None
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_subscriptions: int = DEFAULT_MAX_SUBSCRIPTIONS

    def account(self) -> TenantAccount:
        return TenantAccount(password_hash=self.login.hash,
                             max_connections=self.max_connections,
                             max_subscriptions=self.max_subscriptions)


class AuthState(msgspec.Struct, frozen=True, kw_only=True):
    prefix: str = "plane"
    roles: dict[str, Secret] = msgspec.field(default_factory=dict)
    tenants: dict[str, Tenant] = msgspec.field(default_factory=dict)
    version: int = 1
    # A base config the generated one includes (a cluster's: routes, JetStream's store), as
    # the server will see its path; None: a config of its own (`plane up --auth`).
    include: str | None = None

    @property
    def names(self) -> Names:
        return Names(self.prefix)


def _hash(password: str, rounds: int) -> str:
    import bcrypt  # the 'auth' extra: plane.cli names it when it is missing (plane.contract.extras)

    return bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds, prefix=b"2a")).decode()


def new_secret(user: str, rounds: int = BCRYPT_ROUNDS) -> Secret:
    password = secrets.token_urlsafe(24)  # 192 random bits
    return Secret(user=user, password=password, hash=_hash(password, rounds))


class AuthDir:
    """`AuthDir(path).init()`, `.add_tenant(...)`, `.options(role, url)`."""

    def __init__(self, path: str | os.PathLike[str], *, rounds: int = BCRYPT_ROUNDS) -> None:
        self.path = Path(path).resolve()
        self.rounds = rounds

    @property
    def conf(self) -> Path:
        return self.path / CONF_FILE

    @property
    def pid_file(self) -> Path:
        return self.path / PID_FILE

    def load(self) -> AuthState:
        try:
            raw = (self.path / STATE_FILE).read_bytes()
        except FileNotFoundError:
            raise ConfigError(f"{self.path} has no {STATE_FILE}: run `plane auth init "
                              f"{self.path}` first") from None
        try:
            return msgspec.json.decode(raw, type=AuthState)
        except msgspec.DecodeError as exc:
            raise ConfigError(f"{self.path / STATE_FILE} is not an auth state: {exc}") from exc

    def init(self, prefix: str = "plane", include: str | None = None) -> AuthState:
        """Create the directory's secrets (or keep those it has) and write nats.conf
        (including the config at `include` when given: what compose/ runs)."""
        Names(prefix)  # validates it
        if (self.path / STATE_FILE).exists():
            state = self.load()
            if state.prefix != prefix:
                raise ConfigError(f"{self.path} was made for prefix {state.prefix!r}, not "
                                  f"{prefix!r}: use another directory")
        else:
            state = AuthState(prefix=prefix)
        roles = {r: state.roles.get(r) or new_secret(r, self.rounds) for r in ROLES}
        state = msgspec.structs.replace(state, roles=roles, include=include)
        self._write(state)
        return state

    def add_tenant(self, name: str, *, share: int | None = None,
                   max_rate: int | None = None, max_connections: int | None = None,
                   max_subscriptions: int | None = None, new_password: bool = False) -> Tenant:
        """Add a tenant (or change its settings; its password stays unless `new_password`)
        and rewrite nats.conf. A setting not given keeps its value (its default for a new
        tenant); `max_rate` NO_RATE_LIMIT lifts the tenant's rate limit."""
        check_tenant(name, share=share, max_rate=max_rate, max_connections=max_connections,
                     max_subscriptions=max_subscriptions)
        state = self.load()
        had = state.tenants.get(name) or Tenant(login=new_secret(name, self.rounds))
        given = {"share": share, "max_rate": max_rate, "max_connections": max_connections,
                 "max_subscriptions": max_subscriptions}
        changes: dict[str, int | None] = {k: v for k, v in given.items() if v is not None}
        if changes.get("max_rate") == NO_RATE_LIMIT:
            changes["max_rate"] = None  # what a tenant with no limit holds
        if new_password:  # a leaked one: the server drops its connections at the reload
            had = msgspec.structs.replace(had, login=new_secret(name, self.rounds))
        tenant = msgspec.structs.replace(had, **changes)
        self._write(msgspec.structs.replace(state, tenants={**state.tenants, name: tenant}))
        return tenant

    def remove_tenant(self, name: str) -> Tenant:
        """Remove a tenant and rewrite nats.conf (a server running it drops the tenant's
        connections at its reload, and refuses them after); the tenant it was. Its settings
        in a running plane's PLANE_CONFIG stay, unread: a tenant added again under the name
        finds them, unless `add-tenant` gives others."""
        state = self.load()
        if name not in state.tenants:
            known = ", ".join(sorted(state.tenants)) or "none"
            raise ConfigError(f"{self.path} has no tenant {name!r} (its tenants: {known})")
        gone = state.tenants[name]
        self._write(msgspec.structs.replace(
            state, tenants={t: v for t, v in state.tenants.items() if t != name}))
        return gone

    def options(self, who: str, url: str | None = None, *, name: str | None = None,
                state: AuthState | None = None) -> ConnectOptions:
        """The connection options of a role or a tenant."""
        state = state or self.load()
        login = state.roles.get(who) or (t.login if (t := state.tenants.get(who)) else None)
        if login is None:
            raise ConfigError(f"{self.path} knows no role or tenant {who!r}")
        return ConnectOptions(url=url, user=login.user, password=login.password,
                              name=name or f"plane-{who}")

    def roles(self) -> dict[str, ConnectOptions]:
        """Every role's options, without a URL (a stack gives its own)."""
        state = self.load()
        return {r: self.options(r, state=state) for r in state.roles}

    def tenant_settings(self) -> dict[str, int]:
        """The tenants' live settings, as PLANE_CONFIG keys: `share.<t>`, `max_rate.<t>`."""
        out: dict[str, int] = {}
        for name, t in self.load().tenants.items():
            out[config_key("share", name)] = t.share
            if t.max_rate is not None:
                out[config_key("max_rate", name)] = t.max_rate
        return out

    def reload(self, *, again_after_s: float = RELOAD_AGAIN_AFTER_S) -> bool:
        """Ask the nats-server running this config to reload it (SIGHUP, what `nats-server
        --signal reload` sends), twice, `again_after_s` apart and after. False when none
        runs.

        Twice: nats-server 2.15.1 lets in the users of an account that a reload adds, but
        does not wire that account's service import to the plane's live account: its
        requests find no responders (routers subscribed or not) until the next reload,
        after which they are served (checked: `tests/test_auth.py`)."""
        try:
            pid = int(self.pid_file.read_text().strip())
        except (FileNotFoundError, ValueError):
            return False
        if not _is_nats_server(pid):
            return False
        for _ in range(2):  # a command's blocking pauses, never an event loop's
            os.kill(pid, signal.SIGHUP)
            # Let it finish: a client connecting during a reload may be reset (seen once).
            time.sleep(again_after_s)
        return True

    def server_args(self) -> list[str]:
        """nats-server's arguments for this config, and its pid file for `reload` (the
        embedded server adds its own: address, port, store)."""
        return ["-c", str(self.conf), "-P", str(self.pid_file)]

    def _write(self, state: AuthState) -> None:
        self.path.mkdir(mode=0o700, parents=True, exist_ok=True)
        _write_private(self.path / STATE_FILE, msgspec.json.format(msgspec.json.encode(state)))
        text = render(state.names, PLANE_ACCOUNT,
                      roles={r: s.hash for r, s in state.roles.items()},
                      tenants={t: v.account() for t, v in state.tenants.items()},
                      include=state.include)
        _write_private(self.conf, text.encode())


def check_tenant(name: str, *, share: int | None = None, max_rate: int | None = None,
                 max_connections: int | None = None,
                 max_subscriptions: int | None = None) -> None:
    """What `AuthDir.add_tenant` checks before it writes: a ConfigError naming the flag. For
    a command to check first, before it asks a server anything."""
    if not TOKEN_RE.fullmatch(name) or name in RESERVED:
        raise ConfigError(f"invalid tenant name {name!r}: 1 to 64 characters from A-Z a-z "
                          f"0-9 _ -, none of {', '.join(sorted(RESERVED))}")
    _check_range("share", share)
    _check_range("max_rate", None if max_rate == NO_RATE_LIMIT else max_rate,
                 also=f"or {NO_RATE_LIMIT} for no limit")
    _check_range("max_connections", max_connections, LIMIT_RANGES)
    _check_range("max_subscriptions", max_subscriptions, LIMIT_RANGES)


def _check_range(key: str, value: int | None,
                 ranges: Mapping[str, tuple[int, int]] = RANGES, also: str = "") -> None:
    if value is None:
        return
    low, high = ranges[key]
    if not low <= value <= high:
        raise ConfigError(f"--{key.replace('_', '-')} must be {low}..{high}"
                          + (f" ({also})" if also else ""))


def _write_private(path: Path, data: bytes) -> None:
    """Write `path` with mode 0600, atomically (a reader never sees half of it)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o600)  # an existing tmp file keeps its mode through O_CREAT
    os.replace(tmp, path)


def _is_nats_server(pid: int) -> bool:
    with contextlib.suppress(OSError):
        os.kill(pid, 0)
        cmdline = Path(f"/proc/{pid}/cmdline")
        return not cmdline.exists() or b"nats-server" in cmdline.read_bytes()
    return False
