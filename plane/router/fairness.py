"""Fair shares of slot time between tenants, and each tenant's own limits. Pure: times are
monotonic seconds passed in, weights and limits come from callables (the live settings).

A tenant is who the NATS server says sent the request (`plane.router.tenancy`). Each router
keeps, per model and tenant, two decaying sums (time constant `TAU_S`): the slot time it
*placed* for the tenant (predicted µs, charged at placement) and the slot time the tenant
*asked* for (every arrival, placed or not). While a model's slots are contended (none free,
or holders promised), a tenant that holds more than its fair allocation is refused first
(`Plane-Reason: tenant-share`), and the others keep being admitted.

The allocation is weighted max-min fair over what each tenant asks (water-filling): a
tenant that asks for less than its weighted share gets all it asks, and what it leaves is
shared by the others in proportion to their weights. So one heavy tenant alone gets the
whole plane (work-conserving), and two heavy tenants with weights 1:2 get a third and two
thirds. Several routers each judge the requests they see (the queue group spreads them at
random, so each sees about the same mix).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field

from plane.contract.messages import Reason
from plane.router.rate_limit import RateBucket

TAU_S = 2.0  # the window the shares are judged over (exponential decay time constant)
ASKING_S = 0.5  # a tenant that sent nothing for this long is not asking now
SLACK = 1.05  # a tenant is over its allocation only beyond this factor of it
RETRY_MIN_MS, RETRY_MAX_MS = 1, 1000


@dataclass(slots=True)
class Decaying:
    """A sum that decays exponentially with time constant `TAU_S`."""

    value: float = 0.0
    at_s: float = 0.0

    def read(self, now_s: float) -> float:
        if now_s > self.at_s:
            self.value *= math.exp(-(now_s - self.at_s) / TAU_S)
            self.at_s = now_s
        return self.value

    def add(self, amount: float, now_s: float) -> None:
        self.value = self.read(now_s) + amount


@dataclass(slots=True)
class TenantUse:
    placed: Decaying = field(default_factory=Decaying)
    asked: Decaying = field(default_factory=Decaying)
    in_flight: int = 0
    asked_s: float = -math.inf  # when it last asked
    promises: dict[str, float] = field(default_factory=dict)  # open tickets -> until (s)
    rate: RateBucket = field(default_factory=RateBucket)  # max_rate's (plane.router.rate_limit)


def allocate(asked: dict[str, float], weights: dict[str, float],
             total: float) -> dict[str, float]:
    """Weighted max-min fair shares of `total` over what each tenant asked (water-filling):
    tenants asking for less than their weighted share get what they ask; the rest is
    split by weight among the others."""
    alloc = {t: 0.0 for t in asked}
    left = dict(asked)
    room = total
    while left and room > 1e-9:
        wsum = sum(weights[t] for t in left)
        # Tenants satisfied within their weighted share of what is left get what they ask.
        done = {t for t, a in left.items() if a <= room * weights[t] / wsum}
        if not done:
            for t in left:
                alloc[t] += room * weights[t] / wsum
            return alloc
        for t in done:
            alloc[t] += left[t]
            room -= left[t]
            del left[t]
    return alloc


@dataclass(frozen=True, slots=True)
class OverShare:
    """Refuse: the tenant holds `used_share` of the slot time, its allocation is `share`."""

    used_share: float
    share: float
    retry_after_ms: int


@dataclass(frozen=True, slots=True)
class OverLimit:
    """Refuse: the tenant's own limit (`what`: "max_rate" or "max_slots") is reached. A rate
    refusal books the caller the next token (`ticket`), or says why it cannot (`reason`
    `deadline` or `overloaded`: final)."""

    what: str
    limit: int
    retry_after_ms: int
    ticket: str | None = None
    reason: Reason = Reason.TENANT_LIMIT


class FairShare:
    def __init__(self, weight: Callable[[str], float],
                 max_rate: Callable[[str], int | None] = lambda t: None,
                 max_slots: Callable[[str], int | None] = lambda t: None,
                 new_ticket: Callable[[], str] = lambda: f"t-{secrets.token_hex(8)}"
                 ) -> None:
        self._weight = weight
        self._new_ticket = new_ticket  # a rate refusal's ticket (the router's own kind)
        self._max_rate = max_rate
        self._max_slots = max_slots
        self._use: dict[tuple[str, str], TenantUse] = {}
        self._tenants_of: dict[str, set[str]] = {}  # model -> tenants seen

    def shared(self, model: str) -> bool:
        """More than one tenant has asked for `model` (else nothing to share: fast path)."""
        return len(self._tenants_of.get(model, ())) > 1

    def _of(self, model: str, tenant: str) -> TenantUse:
        use = self._use.get((model, tenant))
        if use is None:
            use = self._use[(model, tenant)] = TenantUse()
            self._tenants_of.setdefault(model, set()).add(tenant)
        return use

    def asked(self, model: str, tenant: str, us: float, now_s: float) -> None:
        """A request arrived (whatever becomes of it): what the tenant asks for."""
        use = self._of(model, tenant)
        use.asked.add(us, now_s)
        use.asked_s = now_s

    def placed(self, model: str, tenant: str, us: float, now_s: float) -> None:
        use = self._of(model, tenant)
        use.placed.add(us, now_s)
        use.in_flight += 1

    def ended(self, model: str, tenant: str) -> None:
        use = self._use.get((model, tenant))
        if use is not None and use.in_flight > 0:
            use.in_flight -= 1

    def limit(self, model: str, tenant: str, now_s: float, cycle_us: float, *,
              ticket: str | None = None, latest_start_s: float = math.inf,
              caller: str = "") -> OverLimit | None:
        """The tenant's own limits, contended or not: a rate (token bucket over all its
        models on this router is what operators expect; kept per model here, which is the
        same for one-model tenants) and a number of slots at once. `ticket`: the one the
        request brought (a rate refusal's holder passes on it); `latest_start_s`: its last
        start that meets its deadline (a token booked later is no use to it); `caller`:
        whose record of coming back decides whether its ticket books a token."""
        use = self._of(model, tenant)
        max_slots = self._max_slots(tenant)
        if max_slots is not None and use.in_flight >= max_slots:
            return OverLimit("max_slots", max_slots,
                             _clamp_ms(cycle_us / 1000))
        rate = self._max_rate(tenant)
        if rate is None:
            if use.rate.booked:
                use.rate.clear()
            return None
        over = use.rate.take(rate, now_s, ticket, latest_start_s, self._new_ticket, caller)
        if over is None:
            return None
        return OverLimit("max_rate", rate, over.retry_after_ms, over.ticket, over.reason)

    def _asking(self, model: str, tenant: str, now_s: float) -> dict[str, TenantUse]:
        """The tenants asking for `model` now (and `tenant`): one that went quiet has nothing
        to be shared with (what it held still decays, but no longer counts)."""
        return {t: self._use[(model, t)] for t in self._tenants_of.get(model, ())
                if now_s - self._use[(model, t)].asked_s <= ASKING_S or t == tenant}

    def over_share(self, model: str, tenant: str, now_s: float, capacity_us_per_s: float,
                   promise_links: int) -> OverShare | None:
        """Whether `tenant` holds more than its fair allocation of `model`'s slot time, or
        more promises than the others leave it (`promise_links`: how many the model's slots
        take; each tenant asking is guaranteed its weight's share of them, so a light tenant
        always finds a promise free). Ask only while the slots are contended."""
        asking = self._asking(model, tenant, now_s)
        if len(asking) < 2:
            return None  # alone: the whole plane is its share
        placed = {t: u.placed.read(now_s) for t, u in asking.items()}
        total = sum(placed.values())
        weights = {t: self._weight(t) for t in asking}
        if total > 0:
            alloc = allocate({t: u.asked.read(now_s) for t, u in asking.items()}, weights,
                             total)[tenant]
            mine = placed[tenant]
            if mine > alloc * SLACK:
                # Back when what it holds above its allocation has been worked off at its
                # own share of the capacity (the others fill the slots meanwhile).
                own_rate = max(1.0, capacity_us_per_s * alloc / total)
                return OverShare(used_share=mine / total, share=alloc / total,
                                 retry_after_ms=_clamp_ms((mine - alloc) / own_rate * 1000))
        wsum = sum(weights.values())
        mine_open = self._open_promises(model, tenant, now_s)
        others = sum(max(len(self._open_promises(model, t, now_s)),
                         math.floor(promise_links * weights[t] / wsum))
                     for t in asking if t != tenant)
        if mine_open and len(mine_open) >= promise_links - others:
            return OverShare(used_share=placed[tenant] / total if total > 0 else 0.0,
                             share=weights[tenant] / wsum,
                             retry_after_ms=_clamp_ms((min(mine_open) - now_s) * 1000))
        return None

    def promised(self, model: str, tenant: str, ticket: str, until_s: float) -> None:
        """A ticket given to `tenant`, open until `until_s` (its due time and tolerance)."""
        self._of(model, tenant).promises[ticket] = until_s

    def kept(self, model: str, tenant: str, ticket: str) -> None:
        use = self._use.get((model, tenant))
        if use is not None:
            use.promises.pop(ticket, None)

    def _open_promises(self, model: str, tenant: str, now_s: float) -> list[float]:
        promises = self._of(model, tenant).promises
        for ticket in [t for t, until in promises.items() if until < now_s]:
            del promises[ticket]
        return list(promises.values())

    def tenants(self) -> set[str]:
        return {t for _, t in self._use}


def _clamp_ms(ms: float) -> int:
    return max(RETRY_MIN_MS, min(RETRY_MAX_MS, math.ceil(ms)))
