"""Who sent a request: the tenant, as the NATS server says.

A tenant is a NATS account that imports the plane's `plane.infer.>` service (`plane auth
add-tenant`). The import shares the requester's identity: nats-server 2.15 adds the header
`Nats-Request-Info` (JSON, `acc` the requesting account) to every request that crosses it,
and overwrites one a caller set (checked: a forged value does not reach the router). A
request sent inside the plane's own account crosses no import and carries no such header:
its sender is a plane role (the gateway), trusted to name the tenant in `Plane-Tenant`.
Without accounts (the default embedded server) everyone is in one account and may name a
tenant; no name is the tenant `default`.

Tenant names become metric labels and fairness state: the first `MAX_TENANTS` names seen get
their own; any later one is counted as `other` (an operator has a few tenants, not thousands).
"""

from __future__ import annotations

from collections.abc import Mapping

from plane.contract.headers import RequestInfo
from plane.contract.subjects import TOKEN_RE, Header

DEFAULT_TENANT = "default"
OTHER_TENANT = "other"
MAX_TENANTS = 64


def named_tenant(headers: Mapping[str, str], info: RequestInfo | None) -> str:
    """The tenant a request's headers name: the server's word first (`info`, what
    `plane.contract.headers.across_import` read of them), else `Plane-Tenant`."""
    if info is not None and (acc := info.acc):
        return acc if TOKEN_RE.fullmatch(acc) else OTHER_TENANT
    name = headers.get(Header.TENANT)
    if not name:
        return DEFAULT_TENANT
    return name if TOKEN_RE.fullmatch(name) else OTHER_TENANT


class Tenants:
    """The tenants this router has seen, bounded."""

    def __init__(self, limit: int = MAX_TENANTS) -> None:
        self._limit = limit
        self._known: set[str] = {DEFAULT_TENANT, OTHER_TENANT}

    def of(self, headers: Mapping[str, str], info: RequestInfo | None) -> str:
        """The tenant of a request (`info`: as for `named_tenant`)."""
        name = named_tenant(headers, info)
        if name in self._known:
            return name
        if len(self._known) >= self._limit:
            return OTHER_TENANT
        self._known.add(name)
        return name
