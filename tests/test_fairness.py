"""Fair shares of slot time between tenants (pure: exact numbers), and who a request's
tenant is (the server's word over the caller's)."""

from __future__ import annotations

import pytest

from plane.contract.headers import across_import
from plane.contract.messages import Reason
from plane.router.caller import caller_of
from plane.router.fairness import FairShare, OverLimit, allocate
from plane.router.tenancy import DEFAULT_TENANT, OTHER_TENANT, Tenants, named_tenant


def test_allocation_is_weighted_max_min_over_what_each_asks() -> None:
    # One light tenant asks for less than its half: it gets all of it, the heavy the rest.
    assert allocate({"a": 300.0, "b": 3000.0}, {"a": 1, "b": 1}, 1000.0) == pytest.approx(
        {"a": 300.0, "b": 700.0})
    # All ask for more than they can have: shares by weight.
    assert allocate({"a": 9e9, "b": 9e9, "c": 9e9}, {"a": 1, "b": 2, "c": 3},
                    600.0) == pytest.approx({"a": 100.0, "b": 200.0, "c": 300.0})
    # Water-filling over two rounds: a is satisfied, b and c split the rest 1:3.
    assert allocate({"a": 50.0, "b": 9e9, "c": 9e9}, {"a": 1, "b": 1, "c": 3},
                    450.0) == pytest.approx({"a": 50.0, "b": 100.0, "c": 300.0})


def heavy_and_light() -> FairShare:
    fair = FairShare(weight=lambda t: 1)
    for _ in range(100):  # the heavy tenant asks for 3x what it got, the light for 300 us
        fair.asked("m", "heavy", 30_000, 0.0)
    for _ in range(10):
        fair.placed("m", "heavy", 10_000, 0.0)
    fair.asked("m", "light", 3_000, 0.0)
    fair.placed("m", "light", 3_000, 0.0)
    return fair


def test_a_tenant_over_its_share_is_refused_and_the_other_is_not() -> None:
    fair = heavy_and_light()
    assert fair.shared("m")
    # light asked 3,000 of 103,000 placed: it gets all it asked; heavy gets the rest (100,000),
    # which is what it holds: neither is over.
    assert fair.over_share("m", "heavy", 0.0, 2e6, 16) is None
    fair.asked("m", "light", 60_000, 0.0)  # light now asks for more than it holds
    over = fair.over_share("m", "heavy", 0.0, 2e6, 16)
    assert over is not None
    # alloc: light 51,500 (half of 103,000), heavy 51,500; heavy holds 100,000 of 103,000.
    assert over.share == pytest.approx(0.5) and over.used_share == pytest.approx(100 / 103)
    # It waits until the excess (48,500 us) is worked off at its share of 2 slots (1e6 us/s).
    assert over.retry_after_ms == 49
    assert fair.over_share("m", "light", 0.0, 2e6, 16) is None


def test_alone_a_tenant_has_the_whole_plane() -> None:
    fair = FairShare(weight=lambda t: 1)
    fair.asked("m", "only", 1e9, 0.0)
    fair.placed("m", "only", 1e9, 0.0)
    assert not fair.shared("m") and fair.over_share("m", "only", 0.0, 1e6, 16) is None


def test_use_decays_so_an_old_burst_is_forgotten() -> None:
    fair = heavy_and_light()
    fair.asked("m", "light", 60_000, 0.0)
    assert fair.over_share("m", "heavy", 0.0, 2e6, 16) is not None
    for t in ("light", "heavy"):  # 15 time constants later: only what they do now counts
        fair.asked("m", t, 10_000, 30.0)
        fair.placed("m", t, 5_000, 30.0)
    assert fair.over_share("m", "heavy", 30.0, 2e6, 16) is None


def test_tenant_limits_slots_and_rate() -> None:
    fair = FairShare(weight=lambda t: 1, max_rate=lambda t: 100 if t == "r" else None,
                     max_slots=lambda t: 2 if t == "s" else None)
    fair.placed("m", "s", 1, 0.0)
    assert fair.limit("m", "s", 0.0, 5000) is None
    fair.placed("m", "s", 1, 0.0)
    assert fair.limit("m", "s", 0.0, 5000) == OverLimit("max_slots", 2, 5)
    fair.ended("m", "s")
    assert fair.limit("m", "s", 0.0, 5000) is None
    # 100/s with a burst of 10: ten pass at once, the eleventh is booked the token due in
    # 10 ms (a ticket), and a newcomer then waits for the one after it.
    assert [fair.limit("m", "r", 0.0, 0) for _ in range(10)] == [None] * 10
    over = fair.limit("m", "r", 0.0, 0)
    assert over is not None and over.ticket is not None
    assert (over.what, over.limit, over.retry_after_ms) == ("max_rate", 100, 10)
    over = fair.limit("m", "r", 0.011, 0)
    assert over is not None and over.retry_after_ms == 9


def rate_limited(rate: int) -> tuple[FairShare, list[str]]:
    """A tenant `r` limited to `rate`/s, its tickets numbered (`t1`, `t2`, ...)."""
    made: list[str] = []

    def new_ticket() -> str:
        made.append(f"t{len(made) + 1}")
        return made[-1]

    return FairShare(weight=lambda t: 1, max_rate=lambda t: rate,
                     new_ticket=new_ticket), made


def test_a_rate_refusal_books_its_holder_the_next_token() -> None:
    """The holder of a rate refusal's ticket, back at its Retry-After, passes, however many
    newcomers of its tenant came meanwhile: they find the token booked. (Before, the
    Retry-After was an estimate: the newcomers took the token and the holder was refused
    again.)"""
    fair, _ = rate_limited(20)  # a token every 50 ms, a burst of 2
    assert fair.limit("m", "r", 0.0, 0) is None and fair.limit("m", "r", 0.0, 0) is None
    first = fair.limit("m", "r", 0.0, 0)
    assert first == OverLimit("max_rate", 20, 50, ticket="t1")
    second = fair.limit("m", "r", 0.010, 0)  # the token after t1's: 90 ms from now
    assert second == OverLimit("max_rate", 20, 90, ticket="t2")
    # Newcomers at 49-50 ms find no token: t1's is booked (they are booked later ones).
    assert fair.limit("m", "r", 0.049, 0) == OverLimit("max_rate", 20, 101, ticket="t3")
    assert fair.limit("m", "r", 0.050, 0) == OverLimit("max_rate", 20, 150, ticket="t4")
    # t1 back on time passes on its ticket (once); t2 too early is told again, same ticket.
    assert fair.limit("m", "r", 0.051, 0, ticket="t1") is None
    assert fair.limit("m", "r", 0.051, 0, ticket="t1") == OverLimit(
        "max_rate", 20, 199, ticket="t5")
    assert fair.limit("m", "r", 0.060, 0, ticket="t2") == OverLimit(
        "max_rate", 20, 40, ticket="t2")
    assert fair.limit("m", "r", 0.101, 0, ticket="t2") is None


def test_a_rate_refusal_that_cannot_be_kept_books_nothing_and_is_final() -> None:
    fair, made = rate_limited(20)
    fair.limit("m", "r", 0.0, 0)
    fair.limit("m", "r", 0.0, 0)
    # Its token comes 50 ms from now, too near its last start (its way back): `deadline`,
    # no ticket.
    assert fair.limit("m", "r", 0.0, 0, latest_start_s=0.055) == OverLimit(
        "max_rate", 20, 50, reason=Reason.DEADLINE)
    # Tokens are booked at most a second ahead: past that, `overloaded`.
    for _ in range(20):
        assert fair.limit("m", "r", 0.0, 0) is not None
    assert fair.limit("m", "r", 0.0, 0) == OverLimit(
        "max_rate", 20, 1050, reason=Reason.OVERLOADED)
    assert len(made) == 20


def test_booked_tokens_nobody_comes_for_lapse_and_stop_being_booked() -> None:
    """A holder that does not come: its token goes back to the bucket 50 ms past its time
    (the tenant is not starved by its no-shows), and once most of a tenant's tickets are
    no-shows its refusals book nothing (the holder that comes goes as a newcomer)."""
    fair, made = rate_limited(20)
    fair.limit("m", "r", 0.0, 0)
    fair.limit("m", "r", 0.0, 0)
    assert fair.limit("m", "r", 0.0, 0) == OverLimit("max_rate", 20, 50, ticket="t1")
    # At 101 ms t1 has lapsed: its token (due at 50 ms) is back, and two more came since.
    assert [fair.limit("m", "r", 0.101, 0) for _ in range(2)] == [None, None]
    now = 0.2
    for _ in range(7):  # seven no-shows in a row: fewer than half redeemed
        now += 1.0
        fair.limit("m", "r", now, 0)
        fair.limit("m", "r", now, 0)
        assert fair.limit("m", "r", now, 0) is not None
    now += 1.0
    fair.limit("m", "r", now, 0)
    fair.limit("m", "r", now, 0)
    unbooked = fair.limit("m", "r", now, 0)
    assert unbooked is not None and unbooked.ticket is not None
    # It booked nothing: a newcomer 50 ms on takes the token; its holder, back, is counted
    # as redeemed and goes as the newcomer it now is.
    assert fair.limit("m", "r", now + 0.050, 0) is None
    assert fair.limit("m", "r", now + 0.050, 0, ticket=unbooked.ticket) is not None
    assert len(made) == 10


def named(headers: dict[str, str]) -> str:
    """The tenant, read as the router reads it (the server's word decoded once)."""
    return named_tenant(headers, across_import(headers))


def test_the_servers_word_names_the_tenant_not_the_callers() -> None:
    info = '{"acc":"TEAM_A","user":"x","rtt":1}'
    assert named({"Nats-Request-Info": info, "Plane-Tenant": "TEAM_B"}) == "TEAM_A"
    assert named({"Plane-Tenant": "TEAM_B"}) == "TEAM_B"
    assert named({}) == DEFAULT_TENANT
    assert named({"Plane-Tenant": "no spaces"}) == OTHER_TENANT
    assert named({"Nats-Request-Info": "not json"}) == DEFAULT_TENANT
    assert named({"Nats-Request-Info": "", "Plane-Tenant": "TEAM_B"}) == "TEAM_B"
    assert across_import({}) is None  # no header: nothing read


def test_a_request_across_an_import_is_read_once() -> None:
    """`across_import`'s one reading serves the tenant and the caller alike."""
    info = across_import({"Nats-Request-Info": '{"acc":"TEAM_A","server":"S1","id":7}'})
    assert info is not None and (info.acc, info.client) == ("TEAM_A", "S1/7")
    assert named_tenant({"Plane-Tenant": "TEAM_B"}, info) == "TEAM_A"
    assert caller_of("_R_.abc.def", info) == "TEAM_A:S1/7"


def test_tenant_names_are_bounded() -> None:
    tenants = Tenants(limit=4)  # default and other, then two more
    assert tenants.of({"Plane-Tenant": "a"}, None) == "a"
    assert tenants.of({"Plane-Tenant": "b"}, None) == "b"
    assert tenants.of({"Plane-Tenant": "c"}, None) == OTHER_TENANT
    assert tenants.of({"Plane-Tenant": "a"}, None) == "a"


def test_a_tenant_holds_at_most_its_share_of_the_promises() -> None:
    """Heavy at its allocation of slot time (not over it) but asking for ever more tickets:
    past its share of the promise links (half of 16 here) it is refused, so the light
    tenant always finds a promise free."""
    fair = FairShare(weight=lambda t: 1)
    for t in ("heavy", "light"):
        fair.asked("m", t, 1e6, 0.0)
        fair.placed("m", t, 10_000, 0.0)
    for i in range(7):
        fair.promised("m", "heavy", f"h{i}", 0.020 + i / 1000)
    assert fair.over_share("m", "heavy", 0.0, 2e6, 16) is None  # 7 of its 8
    fair.promised("m", "heavy", "h7", 0.030)
    over = fair.over_share("m", "heavy", 0.0, 2e6, 16)
    assert over is not None and over.retry_after_ms == 20  # its earliest promise's time
    assert fair.over_share("m", "light", 0.0, 2e6, 16) is None
    fair.kept("m", "heavy", "h0")  # a holder came back: room again
    assert fair.over_share("m", "heavy", 0.0, 2e6, 16) is None
    fair.promised("m", "heavy", "h8", 0.030)
    assert fair.over_share("m", "heavy", 0.040, 2e6, 16) is None  # all lapsed by then


def test_each_tenant_asking_is_guaranteed_its_weights_share_of_the_promises() -> None:
    """Whoever holds how much slot time: light may take promises up to what heavy's
    guarantee (its weight's half of 16) leaves, and no further while heavy asks; once heavy
    has gone quiet, light may have them all."""
    fair = FairShare(weight=lambda t: 1)
    fair.asked("m", "heavy", 1e6, 0.0)
    fair.placed("m", "heavy", 90_000, 0.0)
    fair.asked("m", "light", 20_000, 0.0)
    fair.placed("m", "light", 10_000, 0.0)
    for i in range(7):
        fair.promised("m", "light", f"l{i}", 5.0)
    assert fair.over_share("m", "light", 0.0, 2e6, 16) is None
    fair.promised("m", "light", "l7", 5.0)
    assert fair.over_share("m", "light", 0.0, 2e6, 16) is not None
    fair.asked("m", "light", 1, 1.0)  # a second later heavy has asked nothing for 1 s
    assert fair.over_share("m", "light", 1.0, 2e6, 16) is None
