"""Render nats.conf: the plane's account with its roles, one account per tenant.

    PLANE account    JetStream; users router, node, bridge, gateway, admin, each with the
                     allow lists of `plane.auth.roles`; exports as services (to the tenants'
                     accounts only, once there are any) `<prefix>.infer.<model>` for each
                     model the plane ships, and `<prefix>.cancel.>` (a stream's cancel)
    tenant accounts  no JetStream; one user; import those services with `share: true`, so
                     the router (and a node, for a cancel) sees the server's
                     `Nats-Request-Info` (the requesting account, which a caller cannot
                     forge: the server overwrites the header); the account's limits on
                     connections and subscriptions (`TenantAccount`), so that one tenant's
                     runaway client cannot take the server's from the others
    SYS              the system account, no users: it exports to the plane's account the
                     advisories of closed connections (`$SYS.ACCOUNT.*.DISCONNECT`), so a
                     node stops a stream whose tenant's connection closed (across an import
                     no no-responders status tells it; `gpu_node.streaming`)

One export per model, not `<prefix>.infer.>`: a service's answers cross the import as one
message per request (`response_type: single`, the default: the server drops the mapping of
the reply subject after the first answer) or as many (`stream`: the mapping lives until the
response threshold, or until the requester unsubscribes its reply subject). A model that
streams (`tinylm`) needs `stream`, or a tenant would see a stream's `start` and nothing
after it; but `stream` for every model would keep a mapping per request for 11 minutes
(checked on 2.15.1: 100 `request()` calls left 100 mappings while the caller's muxed inbox
stayed subscribed), millions for a tenant scoring thousands of transactions a second. And
two imports that overlap (`infer.>` and `infer.tinylm`) deliver a request twice (checked),
so each model is its own export and import. A tenant asking for a model the plane does not
ship finds no responder (503) instead of the router's 400.

Passwords are bcrypt hashes (the server compares the hash; the file holds no secret). Every
string is written JSON-quoted, which nats.conf reads as a plain string. No path is written
(no store directory, no pid file): the file works wherever it is mounted, and the command
line says those (`-sd`, `-P`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

from plane.auth.roles import Permissions, role_permissions, tenant
from plane.contract.config import MAX_DEADLINE_MS
from plane.contract.models import MODELS
from plane.contract.subjects import CLIENT_DISCONNECTS, Names

SYSTEM_ACCOUNT = "SYS"
# The longest deadline, plus a minute for the watchdog's answer and the trip back.
RESPONSE_THRESHOLD_S = MAX_DEADLINE_MS // 1000 + 60


@dataclass(frozen=True, kw_only=True)
class TenantAccount:
    """What nats.conf says of a tenant: its one user's password hash and its account's
    limits (the server refuses a connection, or a subscription, past them)."""

    password_hash: str
    max_connections: int
    max_subscriptions: int


def _q(text: str) -> str:
    return json.dumps(text)


def _list(items: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(_q(i) for i in items) + "]"


def _user(user: str, password_hash: str, perms: Permissions, indent: str) -> str:
    return (f"{indent}{{user: {_q(user)}, password: {_q(password_hash)}, permissions: {{\n"
            f"{indent}  publish: {{allow: {_list(perms.publish)}}}\n"
            f"{indent}  subscribe: {{allow: {_list(perms.subscribe)}}}\n"
            f"{indent}}}}}")


def _services(names: Names) -> list[tuple[str, str]]:
    """Each service the plane exports to tenants, with its response type."""
    out = [(names.infer(m), "stream" if spec.streams else "single")
           for m, spec in sorted(MODELS.items())]
    return [*out, (names.cancel_all(), "single")]  # a cancel has no answer


def render(names: Names, plane_account: str, *, roles: Mapping[str, str],
           tenants: Mapping[str, TenantAccount], include: str | None = None) -> str:
    """nats.conf for `roles` (role -> bcrypt hash) and `tenants` (tenant -> its account;
    its one user is named like the tenant); with `include`, on top of that base config
    (which then says how JetStream stores: a cluster's, compose/nats.conf)."""
    perms = role_permissions(names)
    users = ",\n".join(_user(r, h, perms[r], "      ") for r, h in roles.items())
    # The import maps a tenant's reply subject for as long as the threshold (2 min by
    # default): an answer later than that would be dropped, and a deadline may be 10 min.
    to = f", accounts: {_list(sorted(tenants))}" if tenants else ""
    exports = ", ".join(
        f"{{service: {_q(subject)}, response_type: {_q(kind)}, "
        f"response_threshold: {_q(f'{RESPONSE_THRESHOLD_S}s')}{to}}}"
        for subject, kind in _services(names))
    imports = ", ".join(
        f"{{service: {{account: {_q(plane_account)}, subject: {_q(subject)}}}, share: true}}"
        for subject, _ in _services(names))
    out = [
        "# Generated by `plane auth` from auth.json in this directory: do not edit, run",
        "# `plane auth init` / `plane auth add-tenant` again. Passwords are bcrypt hashes.",
        (f"include {_q(include)}  # the base: server, cluster, JetStream's store" if include
         else "jetstream: enabled  # the store: nats-server's -sd DIR (plane up: a temporary one)"),
        f"system_account: {_q(SYSTEM_ACCOUNT)}",
        "accounts: {",
        f"  {_q(SYSTEM_ACCOUNT)}: {{",
        f"    exports: [{{stream: {_q(CLIENT_DISCONNECTS)}, "
        f"accounts: {_list([plane_account])}}}]",
        "  }",
        f"  {_q(plane_account)}: {{",
        "    jetstream: enabled",
        "    users: [",
        users,
        "    ]",
        f"    exports: [{exports}]",
        f"    imports: [{{stream: {{account: {_q(SYSTEM_ACCOUNT)}, "
        f"subject: {_q(CLIENT_DISCONNECTS)}}}}}]",
        "  }",
    ]
    for name, account in sorted(tenants.items()):
        out += [
            f"  {_q(name)}: {{",
            "    users: [",
            _user(name, account.password_hash, tenant(names), "      "),
            "    ]",
            f"    imports: [{imports}]",
            f"    limits: {{max_connections: {account.max_connections}, "
            f"max_subscriptions: {account.max_subscriptions}}}",
            "  }",
        ]
    out.append("}")
    return "\n".join(out) + "\n"
