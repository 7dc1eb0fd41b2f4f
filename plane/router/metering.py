"""What each tenant used: requests by final status, slot time and SM·ms, per model, as this
router saw them (it meters what it refused and what it placed; a placed request's slot time
comes with its done-event, the same `service_us` the caller got in `Plane-Service-Us`).
Exported as Prometheus counters (`plane.contract.metrics.TenantUsage` reads them when
scraped) and, per tenant, from the router's meter endpoint."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import msgspec

from plane.contract.metrics import PlaneMetrics


@dataclass(slots=True)
class Usage:
    statuses: Counter[int] = field(default_factory=Counter)
    slot_us: int = 0
    sm_ms: float = 0.0


class MeterReading(msgspec.Struct, frozen=True, kw_only=True):
    """One tenant's use of one model, as the meter endpoint answers it."""

    tenant: str
    model: str
    requests: dict[str, int]
    slot_us: int
    sm_ms: float


class Meter:
    def __init__(self, metrics: PlaneMetrics) -> None:
        self._usage: dict[tuple[str, str], Usage] = {}
        metrics.tenant_usage.add(self._usage)  # the plane_tenant_* counters read it

    def _of(self, tenant: str, model: str) -> Usage:
        u = self._usage.get((tenant, model))
        if u is None:
            u = self._usage[(tenant, model)] = Usage()
        return u

    def answered(self, tenant: str, model: str, status: int) -> None:
        self._of(tenant, model).statuses[status] += 1

    def used(self, tenant: str, model: str, service_us: int, sms: int) -> None:
        u = self._of(tenant, model)
        u.slot_us += service_us
        u.sm_ms += service_us / 1000 * max(1, sms)

    def readings(self) -> list[MeterReading]:
        return [MeterReading(tenant=t, model=m,
                             requests={str(s): n for s, n in sorted(u.statuses.items())},
                             slot_us=u.slot_us, sm_ms=round(u.sm_ms, 3))
                for (t, m), u in sorted(self._usage.items())]
